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
        if "\0" in self.base_path:  # no file system path holds one; os calls raise ValueError
            raise ConfigError(f"model {self.name!r}: base_path {self.base_path!r} contains a "
                              f"NUL character")
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
    seen = set()
    for spec in specs:  # server_core.cc ValidateModelConfigList
        if spec.name in seen:
            raise ConfigError(f"Illegal to list model {spec.name} multiple times in config list")
        seen.add(spec.name)
    return specs


def parse_error(message_type: str, error: text_format.ParseError) -> str:
    """protobuf's C++ TextFormat error line (`Error parsing text-format <type>: L:C: ...`),
    which TF Serving prints on stderr and scripts grep for."""
    line, column = error.GetLine(), error.GetColumn()
    detail = str(error)
    if line is not None:
        detail = detail.split(" : ", 1)[-1]
        return f"Error parsing text-format {message_type}: {line}:{column}: {detail}"
    return f"Error parsing text-format {message_type}: {detail}"


def parse_model_server_config(text: str, source: str = "") -> list[ModelSpecConfig]:
    """Parses text-format ModelServerConfig (`model_config_list { config { ... } }`)."""
    config = model_server_config_pb2.ModelServerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        message = parse_error(config.DESCRIPTOR.full_name, error)
        if source:  # and TF Serving's status for the file
            message += f". Invalid protobuf file: '{source}'"
        raise ConfigError(message) from error
    return from_proto(config)


def read_model_config_file(path: str | Path) -> list[ModelSpecConfig]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read model config file {path}: {error}") from error
    return parse_model_server_config(text, str(path))
