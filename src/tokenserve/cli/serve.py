"""`tokenserve serve`: a drop-in for tensorflow_model_server (same flags, same APIs).

    tokenserve serve --port=8500 --rest_api_port=8501 --model_name=m --model_base_path=/models/m
    tokenserve serve --model_config_file=/models/models.config \
        --model_config_file_poll_wait_seconds=30 --monitoring_config_file=/models/monitoring.config
    tokenserve serve                      # the built-in model, as `builtin`
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tokenserve.errors import ConfigError

# tensorflow_model_server flags that tokenserve accepts and ignores (with a one-line warning),
# so existing launch scripts run unchanged.
IGNORED_TFSERVING_FLAGS = (
    "rest_api_num_threads", "enable_per_model_batching_parameters", "allow_version_labels",
    "flush_filesystem_caches", "tensorflow_session_config_file", "use_alts_credentials",
    "ssl_config_file", "platform_config_file", "per_process_gpu_memory_fraction",
    "remove_unused_fields_from_bundle_metagraph", "num_tflite_pools",
    "num_tflite_interpreters_per_pool", "num_tflite_interpreters", "use_tflite_model",
    "enable_signature_method_name_check", "xla_cpu_compilation_enabled", "enable_profiler",
    "thread_pool_factory_config_file", "mixed_precision", "skip_initialize_tpu",
    "enable_grpc_healthcheck_service", "enable_serialization_as_tensor_content",
)

_TRUE = {"true", "1", "yes", "t", "y"}
_FALSE = {"false", "0", "no", "f", "n"}


def parse_bool(text: str) -> bool:
    """absl-style bool flag values: `--enable_batching`, `--enable_batching=true|false`."""
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "serve", help="serve models (TF Serving REST and gRPC APIs, OpenAI API)",
        description="A drop-in for tensorflow_model_server: same flags and defaults, TF "
                    "Serving's REST (8501) and gRPC (8500) APIs, version lifecycle, hot reload "
                    "and warmup. With no model flags it serves the built-in model as "
                    "'builtin'.")
    defaults = {f.name: f.default for f in dataclasses.fields(_config_class())}
    ints = ("port", "rest_api_port", "rest_api_timeout_in_ms", "grpc_max_threads",
            "model_config_file_poll_wait_seconds", "file_system_poll_wait_seconds",
            "num_request_iterations_for_warmup", "max_num_load_retries",
            "load_retry_interval_micros", "openai_port", "tensorflow_session_parallelism",
            "tensorflow_intra_op_parallelism", "tensorflow_inter_op_parallelism")
    strings = ("grpc_socket_path", "grpc_channel_arguments", "model_name", "model_base_path",
               "model_config_file", "batching_parameters_file", "monitoring_config_file",
               "host", "saved_model_tags")
    bools = ("enable_batching", "enable_model_warmup", "rest_api_enable_cors_support",
             "allow_version_labels_for_unavailable_models", "prefer_tflite_model")
    for name in ints:
        p.add_argument(f"--{name}", type=int, default=defaults[name])
    for name in strings:
        p.add_argument(f"--{name}", default=defaults[name])
    for name in bools:
        p.add_argument(f"--{name}", type=parse_bool, nargs="?", const=True,
                       default=defaults[name], metavar="true|false")
    p.add_argument("--version", action=_PrintVersion, nargs=0,
                   help="print the versions and exit, as tensorflow_model_server --version")
    p.add_argument("--api_key", action="append", default=[],
                   help="accepted API key for the OpenAI API (repeatable)")
    for name in IGNORED_TFSERVING_FLAGS:
        p.add_argument(f"--{name}", nargs="?", const="true", default=None,
                       help=argparse.SUPPRESS)
    p.set_defaults(run=run)


class _PrintVersion(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(_version_text())
        parser.exit(0)


def _version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"
    return (f"TensorFlow ModelServer: tokenserve {installed('tokenserve')} (TF Serving API "
            f"{installed('tensorflow-serving-api')})\nTensorFlow Library: "
            f"{installed('tensorflow')}")


def _config_class():
    from tokenserve.server.serve_config import ServeConfig
    return ServeConfig


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The TF Serving flags given that tokenserve does not use."""
    return [name for name in IGNORED_TFSERVING_FLAGS if getattr(args, name, None) is not None]


def config_from_args(args: argparse.Namespace):
    """A ServeConfig from parsed flags (reads the batching and monitoring files)."""
    config_class = _config_class()
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)
              if hasattr(args, f.name)}
    values["api_keys"] = tuple(args.api_key)
    return config_class(**values)


def run(args: argparse.Namespace) -> int:
    for name in ignored_flags(args):
        print(f"tokenserve serve: warning: --{name} is a tensorflow_model_server flag that "
              f"tokenserve does not use; ignored", file=sys.stderr)
    if args.model_config_file and args.model_base_path:
        # TF Serving's Docker entrypoint always passes --model_base_path, so a config file
        # next to it is normal: the config file wins, as in tensorflow_model_server.
        print("tokenserve serve: warning: --model_name and --model_base_path are ignored "
              "because --model_config_file is set", file=sys.stderr)
    config = config_from_args(args)
    from tokenserve.server.tfserving.server import serve

    try:
        serve(config)
    except OSError as error:  # port in use, socket path not writable ...
        raise ConfigError(f"cannot start serving: {error}") from error
    return 0
