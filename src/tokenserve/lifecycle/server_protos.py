"""Text protos that tensorflow-serving-api's wheel does not ship: `MonitoringConfig`
(--monitoring_config_file) and `BatchingParameters` (--batching_parameters_file).

Their message types are declared here with TF Serving's field names (text format goes by name), so the
official text format parser reads existing files unchanged (unknown fields are errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, text_format, wrappers_pb2
from google.protobuf.message_factory import GetMessageClass

from tokenserve.errors import ConfigError

_F = descriptor_pb2.FieldDescriptorProto


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(
        name="tokenserve/tfserving_server_protos.proto", package="tensorflow.serving",
        syntax="proto3", dependency=["google/protobuf/wrappers.proto"])

    def message(name, fields):
        msg = proto.message_type.add(name=name)
        for number, (field_name, kind, type_name, label) in enumerate(fields, start=1):
            entry = msg.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                entry.type_name = type_name

    one, many = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    message("PrometheusConfig", [("enable", _F.TYPE_BOOL, None, one),
                                 ("path", _F.TYPE_STRING, None, one)])
    message("MonitoringConfig", [("prometheus_config", _F.TYPE_MESSAGE,
                                  ".tensorflow.serving.PrometheusConfig", one)])
    int64, boolean = ".google.protobuf.Int64Value", ".google.protobuf.BoolValue"
    message("BatchingParameters", [
        ("max_batch_size", _F.TYPE_MESSAGE, int64, one),
        ("batch_timeout_micros", _F.TYPE_MESSAGE, int64, one),
        ("max_enqueued_batches", _F.TYPE_MESSAGE, int64, one),
        ("num_batch_threads", _F.TYPE_MESSAGE, int64, one),
        ("thread_pool_name", _F.TYPE_MESSAGE, ".google.protobuf.StringValue", one),
        ("allowed_batch_sizes", _F.TYPE_INT64, None, many),
        ("pad_variable_length_inputs", _F.TYPE_BOOL, None, one),
        ("enable_large_batch_splitting", _F.TYPE_MESSAGE, boolean, one),
        ("max_execution_batch_size", _F.TYPE_MESSAGE, int64, one),
    ])
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
_POOL.Add(_file())
MonitoringConfigProto = GetMessageClass(
    _POOL.FindMessageTypeByName("tensorflow.serving.MonitoringConfig"))
BatchingParametersProto = GetMessageClass(
    _POOL.FindMessageTypeByName("tensorflow.serving.BatchingParameters"))

DEFAULT_PROMETHEUS_PATH = "/monitoring/prometheus/metrics"


@dataclass(frozen=True)
class MonitoringConfig:
    """Prometheus on the REST port at `prometheus_path` when `prometheus_enabled`."""

    prometheus_enabled: bool = False
    prometheus_path: str = DEFAULT_PROMETHEUS_PATH


@dataclass(frozen=True)
class BatchingParameters:
    """TF Serving's batching knobs (defaults are TF Serving's), for whatever batches requests."""

    max_batch_size: int = 32
    batch_timeout_micros: int = 0
    max_enqueued_batches: int = 100
    num_batch_threads: int = 4  # TF Serving: the number of CPUs
    thread_pool_name: str = "batch_threads"
    allowed_batch_sizes: tuple[int, ...] = field(default_factory=tuple)
    pad_variable_length_inputs: bool = False
    enable_large_batch_splitting: bool = False
    max_execution_batch_size: int | None = None
    fields_set: frozenset[str] = frozenset()
    """The fields the parsed file set; the others hold TF Serving's defaults."""

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        sizes = list(self.allowed_batch_sizes)
        if sizes and (sizes != sorted(sizes) or sizes[-1] != self.max_batch_size):
            raise ConfigError("allowed_batch_sizes must increase and end with max_batch_size")


def _parse(text: str, message, what: str):
    from tokenserve.lifecycle.model_config import parse_error

    try:
        text_format.Parse(text, message)
    except text_format.ParseError as error:
        raise ConfigError(f"invalid {what}: "
                          f"{parse_error(message.DESCRIPTOR.full_name, error)}") from error
    return message


def _read(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error}") from error


def parse_monitoring_config(text: str) -> MonitoringConfig:
    proto = _parse(text, MonitoringConfigProto(), "monitoring config")
    prometheus = proto.prometheus_config
    return MonitoringConfig(prometheus_enabled=prometheus.enable,
                            prometheus_path=prometheus.path or DEFAULT_PROMETHEUS_PATH)


def read_monitoring_config(path: str | Path) -> MonitoringConfig:
    return parse_monitoring_config(_read(path, "monitoring config file"))


def parse_batching_parameters(text: str) -> BatchingParameters:
    proto = _parse(text, BatchingParametersProto(), "batching parameters")
    values = {}
    for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches",
                 "num_batch_threads", "thread_pool_name", "enable_large_batch_splitting",
                 "max_execution_batch_size"):
        if proto.HasField(name):
            values[name] = getattr(proto, name).value
    values["allowed_batch_sizes"] = tuple(proto.allowed_batch_sizes)
    values["pad_variable_length_inputs"] = proto.pad_variable_length_inputs
    fields_set = frozenset(descriptor.name for descriptor, _ in proto.ListFields())
    return BatchingParameters(**values, fields_set=fields_set)


def read_batching_parameters(path: str | Path) -> BatchingParameters:
    return parse_batching_parameters(_read(path, "batching parameters file"))
