"""`--model_config_file`: TF Serving's text `ModelServerConfig`, as typed model specs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from tokenserve.errors import ConfigError
from tokenserve.lifecycle.policy import VersionPolicy

SUPPORTED_PLATFORMS = ("tensorflow", "tflite")


@dataclass(frozen=True)
class ModelSpecConfig:
    """One served model: where its versions live and which of them to serve."""

    name: str
    base_path: str
    platform: str = "tensorflow"
    """`tensorflow` (SavedModel, or model.tflite with --prefer_tflite_model) or `tflite`."""
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    labels: dict[str, int] = field(default_factory=dict)
    """Version labels (`stable` -> 1), resolved by `/labels/{label}` and ModelSpec.version_label."""

    def __post_init__(self):
        if not self.name:
            raise ConfigError("a model config needs a name")
        if not self.base_path:
            raise ConfigError(f"model {self.name!r} needs a base_path")
        if self.platform not in SUPPORTED_PLATFORMS:
            raise ConfigError(f"model {self.name!r}: unsupported model_platform "
                              f"{self.platform!r} (supported: {', '.join(SUPPORTED_PLATFORMS)})")


def _policy(proto) -> VersionPolicy:
    which = proto.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy.all()
    if which == "specific":
        return VersionPolicy.specific(proto.specific.versions)
    if which == "latest":
        return VersionPolicy.latest(proto.latest.num_versions or 1)
    return VersionPolicy.latest(1)  # TF Serving's default


def from_proto(config: model_server_config_pb2.ModelServerConfig) -> list[ModelSpecConfig]:
    """Typed specs from a parsed ModelServerConfig; refuses duplicates and custom configs."""
    if config.WhichOneof("config") == "custom_model_config":
        raise ConfigError("custom_model_config is not supported; use model_config_list")
    specs = []
    for model in config.model_config_list.config:
        specs.append(ModelSpecConfig(
            name=model.name, base_path=model.base_path,
            platform=model.model_platform or "tensorflow",
            policy=_policy(model.model_version_policy),
            labels={label: int(version) for label, version in model.version_labels.items()}))
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"duplicate model names in config: {', '.join(duplicates)}")
    return specs


def parse_model_server_config(text: str) -> list[ModelSpecConfig]:
    """Parses text-format ModelServerConfig (`model_config_list { config { ... } }`)."""
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        raise ConfigError(f"invalid model config: {error}") from error
    return from_proto(config)


def read_model_config_file(path: str | Path) -> list[ModelSpecConfig]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read model config file {path}: {error}") from error
    return parse_model_server_config(text)
