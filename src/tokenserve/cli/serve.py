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

from tokenserve.cli.lora_flags import add_lora_flags, lora_engine_options, parse_lora_modules
from tokenserve.errors import ConfigError

# tensorflow_model_server flags that tokenserve accepts and ignores (with a one-line warning),
# so existing launch scripts run unchanged.
IGNORED_TFSERVING_FLAGS = (
    "rest_api_num_threads", "enable_per_model_batching_parameters", "allow_version_labels",
    "flush_filesystem_caches", "tensorflow_session_config_file", "use_alts_credentials",
    "platform_config_file", "per_process_gpu_memory_fraction",
    "remove_unused_fields_from_bundle_metagraph", "num_tflite_pools",
    "num_tflite_interpreters_per_pool", "num_tflite_interpreters", "use_tflite_model",
    "xla_cpu_compilation_enabled", "enable_profiler",
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
               "host", "saved_model_tags", "ssl_config_file")
    bools = ("enable_batching", "enable_model_warmup", "rest_api_enable_cors_support",
             "allow_version_labels_for_unavailable_models", "prefer_tflite_model",
             "enable_signature_method_name_check")
    for name in ints:
        p.add_argument(f"--{name}", type=int, default=defaults[name])
    for name in strings:
        p.add_argument(f"--{name}", default=defaults[name])
    for name in bools:
        p.add_argument(f"--{name}", type=parse_bool, nargs="?", const=True,
                       default=defaults[name], metavar="true|false")
    p.add_argument("--graceful_shutdown_seconds", type=float,
                   default=defaults["graceful_shutdown_seconds"],
                   help="after SIGTERM, cancel HTTP requests still running after this long "
                        "(match it to Kubernetes' terminationGracePeriodSeconds less preStop)")
    p.add_argument("--version", action=_PrintVersion, nargs=0,
                   help="print the versions and exit, as tensorflow_model_server --version")
    p.add_argument("--api_key", action="append", default=[],
                   help="accepted API key (repeatable; also TOKENSERVE_API_KEYS=k1,k2): "
                        "every endpoint then needs 'Authorization: Bearer <key>' except "
                        "health, readiness and the OpenAPI schema")
    p.add_argument("--metrics_public", type=parse_bool, nargs="?", const=True,
                   default=defaults["metrics_public"], metavar="true|false",
                   help="serve Prometheus metrics without an API key")
    _add_llm_flags(p)
    for name in IGNORED_TFSERVING_FLAGS:
        p.add_argument(f"--{name}", nargs="?", const="true", default=None,
                       help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _add_llm_flags(p) -> None:
    """tokenserve's own flags: the engine, the OpenAI frontend and observability."""
    from tokenserve.server.config import LLMServeConfig

    llm = LLMServeConfig()
    engine = llm.engine
    g = p.add_argument_group("engine (continuous batching)")
    g.add_argument("--max_num_seqs", type=int, default=engine.max_num_seqs,
                   help="most sequences in the running batch")
    g.add_argument("--max_num_batched_tokens", type=int, default=engine.max_num_batched_tokens,
                   help="token budget of one engine step (decode first, then prefill chunks)")
    g.add_argument("--kv_cache_tokens", type=int, default=None,
                   help="KV-cache capacity in positions (default: max_num_seqs x context)")
    g.add_argument("--kv_cache_dtype", default=engine.kv_cache_dtype,
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV-cache storage; auto = 16 bits (float16 under float32 compute)")
    g.add_argument("--kv_cache_memory_bytes", type=int, default=None,
                   help="size the KV cache to this many bytes (capacity logged at load)")
    g.add_argument("--kv_cache_memory_fraction", type=float, default=None,
                   help="size the KV cache so the process uses this fraction of its memory "
                        "limit (cgroup, else RAM), as vLLM's gpu_memory_utilization")
    g.add_argument("--kv_cache_lazy_pages", type=parse_bool, nargs="?", const=True,
                   default=engine.kv_cache_lazy_pages, metavar="true|false",
                   help="leave the KV pool's pages to the OS until blocks are written (RSS "
                        "grows with use); false: the whole pool resident from the start")
    g.add_argument("--precision", default=engine.precision,
                   choices=["auto", "float32", "bfloat16"],
                   help="engine compute dtype; auto = bfloat16 on AMX/AVX512-BF16 CPUs")
    g.add_argument("--max_fused_dense_tokens", type=int, default=engine.max_fused_dense_tokens,
                   help="steps of at most this many tokens run fused dense ops instead of XLA "
                        "programs (float32) or oneDNN's bf16 matmuls (bfloat16); default: "
                        "chosen for this CPU and dtype (logged), 0: never")
    g.add_argument("--max_screened_head_rows", type=int, default=engine.max_screened_head_rows,
                   help="float32 or bfloat16 weights: greedy steps of at most this many "
                        "sequences run the LM head on a smaller copy (--head_screen) and "
                        "recompute in float32 only the tokens that could win (the same "
                        "tokens, fewer reads); 0: never")
    g.add_argument("--head_screen", default=engine.head_screen, choices=["int8", "float16"],
                   help="the screened LM head's copy: int8 with a scale per row (a quarter of "
                        "the float32 head's bytes) or float16 (half; float32 heads only)")
    g.add_argument("--num_speculative_tokens", type=int, default=engine.num_speculative_tokens,
                   help="speculative decoding: requests check up to this many tokens copied "
                        "from their own earlier text per step (n-gram drafts; greedy output "
                        "unchanged, sampled output the same distribution; fewer steps where "
                        "text repeats); 0: off")
    g.add_argument("--speculative_ngram_min", type=int, default=engine.speculative_ngram_min,
                   help="shortest tail looked up for n-gram drafts")
    g.add_argument("--speculative_ngram_max", type=int, default=engine.speculative_ngram_max,
                   help="longest tail looked up for n-gram drafts")
    g.add_argument("--speculative_max_seqs", type=int, default=engine.speculative_max_seqs,
                   help="draft only while at most this many sequences run")
    g.add_argument("--speculative_max_step_tokens", type=int,
                   default=engine.speculative_max_step_tokens,
                   help="no more drafts once a step's sequences and drafts reach this many "
                        "tokens")
    g.add_argument("--max_queue_requests", type=int, default=engine.max_queue_requests,
                   help="waiting requests beyond this get HTTP 429 / RESOURCE_EXHAUSTED")
    g.add_argument("--max_queue_tokens", type=int, default=engine.max_queue_tokens,
                   help="waiting prompt tokens beyond this get HTTP 429")
    g.add_argument("--preempt_for_priority", type=parse_bool, nargs="?", const=True,
                   default=False, metavar="true|false",
                   help="let higher-priority requests preempt running lower-priority ones")
    g.add_argument("--enable_prefix_caching", type=parse_bool, nargs="?", const=True,
                   default=engine.enable_prefix_caching, metavar="true|false",
                   help="reuse the KV blocks of cached prompt prefixes (default on; "
                        "--noenable_prefix_caching turns it off)")
    g.add_argument("--noenable_prefix_caching", dest="enable_prefix_caching",
                   action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--kv_store", default=None, metavar="redis://HOST:PORT/DB",
                   help="share full KV blocks between replicas through this Redis")
    g.add_argument("--kv_store_ttl_s", type=float, default=engine.kv_store_ttl_s,
                   help="lifetime of a KV block written to --kv_store")
    g.add_argument("--state_store", default=None, metavar="redis://HOST:PORT/DB",
                   help="keep Responses-API conversations in this Redis (default: in "
                        "process), so any replica continues any conversation")
    add_lora_flags(p)
    g = p.add_argument_group("OpenAI API and observability")
    g.add_argument("--ui", type=parse_bool, nargs="?", const=True, default=llm.ui,
                   metavar="true|false",
                   help="serve the browser playground and dashboard at / on the OpenAI port "
                        "(default on; --noui turns it off)")
    g.add_argument("--noui", dest="ui", action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--release_file_pages", type=parse_bool, nargs="?", const=True,
                   default=llm.release_file_pages, metavar="true|false",
                   help="once an engine has warmed up, unmap the shared-library pages that "
                        "start-up touched (about 320 MB less RSS; no anonymous memory)")
    g.add_argument("--idle_trim_s", type=float, default=engine.idle_trim_s,
                   help="once the engine has been idle this long after a step, return the "
                        "heap its steps freed to the OS (malloc_trim); a negative value: never")
    g.add_argument("--request_timeout_s", type=float, default=llm.request_timeout_s,
                   help="deadline of each generation request")
    g.add_argument("--max_request_body_bytes", type=int, default=llm.max_body_bytes,
                   help="larger OpenAI request bodies get HTTP 413")
    g.add_argument("--reasoning_parser", default=llm.reasoning_parser, metavar="NAME",
                   help="split a thinking model's chat replies into reasoning_content and "
                        "content, by vLLM's parser names (qwen3, deepseek_r1); auto (the "
                        "default): for a model whose chat template writes <think>; none: off")
    g.add_argument("--otlp_traces_endpoint", default=None,
                   help="export OpenTelemetry traces (OTLP/HTTP), e.g. http://collector:4318")
    g.add_argument("--tensorboard_logdir", default=None,
                   help="write periodic tf.summary latency/throughput summaries here")
    g.add_argument("--log_format", default="plain", choices=["plain", "json"],
                   help="json: one object per line, with the request id")


def llm_config_from_args(args: argparse.Namespace):
    from tokenserve.engine.config import EngineConfig
    from tokenserve.observability.stack import ObservabilityConfig
    from tokenserve.server.config import LLMServeConfig

    engine = EngineConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_cache_tokens=args.kv_cache_tokens, precision=args.precision,
                          kv_cache_dtype=args.kv_cache_dtype,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          kv_cache_lazy_pages=args.kv_cache_lazy_pages,
                          max_fused_dense_tokens=args.max_fused_dense_tokens,
                          max_screened_head_rows=args.max_screened_head_rows,
                          head_screen=args.head_screen,
                          num_speculative_tokens=args.num_speculative_tokens,
                          speculative_ngram_min=args.speculative_ngram_min,
                          speculative_ngram_max=args.speculative_ngram_max,
                          speculative_max_seqs=args.speculative_max_seqs,
                          speculative_max_step_tokens=args.speculative_max_step_tokens,
                          max_queue_requests=args.max_queue_requests,
                          max_queue_tokens=args.max_queue_tokens,
                          preempt_for_priority=args.preempt_for_priority,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_store=args.kv_store, kv_store_ttl_s=args.kv_store_ttl_s,
                          idle_trim_s=None if args.idle_trim_s < 0 else args.idle_trim_s,
                          **lora_engine_options(args))
    observability = ObservabilityConfig(otlp_traces_endpoint=args.otlp_traces_endpoint,
                                        tensorboard_logdir=args.tensorboard_logdir,
                                        log_format=args.log_format)
    return LLMServeConfig(engine=engine, observability=observability,
                          request_timeout_s=args.request_timeout_s,
                          max_body_bytes=args.max_request_body_bytes,
                          state_store=args.state_store, ui=args.ui,
                          release_file_pages=args.release_file_pages,
                          reasoning_parser=args.reasoning_parser,
                          lora_modules=parse_lora_modules(args.lora_modules))


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
    from tokenserve.server.config import ServeConfig
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
    llm = llm_config_from_args(args)
    from tokenserve.host.python_heap import collector_paused

    with collector_paused():  # the web stack's imports
        from tokenserve.server.launch import run as launch
        from tokenserve.server.openai.reasoning import check_parser_name

    check_parser_name(llm.reasoning_parser)  # before any model loads

    try:
        launch(config, llm)
    except OSError as error:  # port in use, socket path not writable ...
        raise ConfigError(f"cannot start serving: {error}") from error
    return 0
