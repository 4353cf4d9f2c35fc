"""`tokenserve serve` flags: tensorflow_model_server's names, defaults and value forms."""

from __future__ import annotations

import pytest

from tokenserve.cli.main import build_parser, main
from tokenserve.cli.serve import config_from_args, ignored_flags
from tokenserve.errors import ConfigError
from tokenserve.server.config import BUILTIN_MODEL_NAME, ServeConfig


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_tensorflow_model_servers():
    config = config_from_args(parse())
    assert (config.port, config.rest_api_port, config.openai_port) == (8500, 8501, 8000)
    assert config.rest_api_timeout_in_ms == 30000
    assert config.model_name == "default" and config.model_base_path == ""
    assert config.file_system_poll_wait_seconds == 1
    assert config.model_config_file_poll_wait_seconds == 0
    assert config.max_num_load_retries == 5
    assert config.load_retry_interval_micros == 60_000_000
    assert config.enable_model_warmup is True and config.enable_batching is False
    assert config.prefer_tflite_model is False
    assert config.allow_version_labels_for_unavailable_models is False
    assert config.batching_parameters is None and not config.monitoring.prometheus_enabled
    assert config.serves_builtin and config.api_keys == ()
    assert BUILTIN_MODEL_NAME == "builtin"


def test_value_forms_and_repeatable_api_key(tmp_path):
    batching = tmp_path / "batching.config"
    batching.write_text("max_batch_size { value: 16 }\nnum_batch_threads { value: 2 }\n")
    config = config_from_args(parse(
        "--port", "9000", "--rest_api_port=0", "--model_name", "m",
        "--model_base_path=/models/m", "--enable_batching", "--enable_model_warmup=false",
        "--prefer_tflite_model", "true", f"--batching_parameters_file={batching}",
        "--api_key", "k1", "--api_key=k2", "--openai_port=0"))
    assert (config.port, config.rest_api_port, config.openai_port) == (9000, 0, 0)
    assert config.enable_batching is True and config.enable_model_warmup is False
    assert config.prefer_tflite_model is True
    assert config.batching_parameters.max_batch_size == 16
    assert config.batching_parameters.num_batch_threads == 2
    assert config.api_keys == ("k1", "k2")
    [spec] = config.model_specs()
    assert (spec.name, spec.base_path) == ("m", "/models/m")


def test_batching_parameters_file_is_parsed_once_and_maps_onto_the_engine(tmp_path):
    """The file ServeConfig parsed drives the engine too; only the fields it sets count."""
    from tokenserve.engine.config import EngineConfig
    from tokenserve.server.config import LLMServeConfig, engine_config_for

    batching = tmp_path / "batching.config"
    batching.write_text("max_batch_size { value: 8 }\nbatch_timeout_micros { value: 2000 }\n"
                        "max_enqueued_batches { value: 4 }\nnum_batch_threads { value: 2 }\n"
                        "allowed_batch_sizes: 4\nallowed_batch_sizes: 8\n")
    base = EngineConfig(max_num_seqs=3, max_queue_requests=7)
    config = config_from_args(parse(f"--batching_parameters_file={batching}"))
    engine = engine_config_for(config, base)
    assert (engine.max_num_seqs, engine.batch_wait_s, engine.max_queue_requests,
            engine.batch_sizes) == (8, 0.002, 32, (4, 8))
    batching.write_text("batch_timeout_micros { value: 500 }\n")
    engine = engine_config_for(config_from_args(parse(f"--batching_parameters_file={batching}")),
                               base)
    assert (engine.max_num_seqs, engine.batch_wait_s, engine.max_queue_requests) == \
        (3, 0.0005, 7)  # the flags' values stay where the file is silent
    assert engine_config_for(config_from_args(parse("--enable_batching")), base) == base
    assert LLMServeConfig().engine == EngineConfig()
    batching.write_text("max_batch_size: 8")  # not TF Serving's text format: refused at once
    with pytest.raises(ConfigError):
        config_from_args(parse(f"--batching_parameters_file={batching}"))


def test_request_limits_have_one_default():
    """The request deadline and body limit default once (server.config) for the flags, the
    OpenAI frontend and the gRPC generation service."""
    import inspect

    from tokenserve.server import config as server_config
    from tokenserve.server.grpc_generate import add_generation_service
    from tokenserve.server.openai.config import OpenAIServerConfig

    args = parse()
    assert args.request_timeout_s == OpenAIServerConfig().request_timeout_s == \
        inspect.signature(add_generation_service).parameters["request_timeout_s"].default == \
        server_config.LLMServeConfig().request_timeout_s == server_config.REQUEST_TIMEOUT_S
    assert args.max_request_body_bytes == OpenAIServerConfig().max_body_bytes == \
        server_config.LLMServeConfig().max_body_bytes == server_config.MAX_BODY_BYTES


def test_real_but_unused_tf_serving_flags_are_accepted():
    args = parse("--rest_api_num_threads", "2",
                 "--enable_signature_method_name_check", "--xla_cpu_compilation_enabled=true",
                 "--platform_config_file=/p.cfg", "--port=1")
    assert ignored_flags(args) == ["rest_api_num_threads", "platform_config_file",
                                   "xla_cpu_compilation_enabled"]
    config = config_from_args(args)
    assert config.port == 1
    # used, not ignored: TF Serving's TF1 method_name check for Predict/Classify/Regress
    assert config.enable_signature_method_name_check is True
    assert config_from_args(parse()).enable_signature_method_name_check is False


def test_tensorflow_threads_tags_and_cors_flags():
    config = config_from_args(parse("--tensorflow_session_parallelism=2",
                                    "--tensorflow_inter_op_parallelism", "1",
                                    "--saved_model_tags=serve,gpu",
                                    "--rest_api_enable_cors_support=true"))
    assert (config.intra_op_threads, config.inter_op_threads) == (2, 1)
    assert config.tags == ("serve", "gpu")
    assert config.rest_api_enable_cors_support is True
    assert config_from_args(parse()).tags == ("serve",)


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as raised:
        parse("--enable_batching=maybe")
    assert raised.value.code == 2
    with pytest.raises(SystemExit):
        parse("--not_a_tf_serving_flag=1")


def test_config_errors(tmp_path):
    models = tmp_path / "models.config"
    models.write_text('model_config_list { config { name: "a" base_path: "/a" } }')
    both = ServeConfig(model_config_file=str(models), model_name="m", model_base_path="/b")
    assert [(s.name, s.base_path) for s in both.model_specs()] == [("a", "/a")]  # file wins
    with pytest.raises(ConfigError, match="port"):
        ServeConfig(port=70000)
    with pytest.raises(ConfigError, match="graceful_shutdown_seconds"):
        ServeConfig(graceful_shutdown_seconds=-1)
    monitoring = tmp_path / "monitoring.config"
    monitoring.write_text("prometheus_config { enabled: true }")  # misspelt field
    with pytest.raises(ConfigError, match="invalid monitoring config"):
        ServeConfig(monitoring_config_file=str(monitoring))


def test_cli_reports_a_bad_model_config_file_on_one_line(tmp_path, capsys):
    config = tmp_path / "models.config"
    config.write_text('model_config_list { config { name: "m" } }')  # no base_path
    code = main(["serve", f"--model_config_file={config}", "--port=0", "--rest_api_port=0",
                 "--file_system_poll_wait_seconds=0", "--model_base_path=/models/default"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ("tokenserve serve: warning: --model_name and --model_base_path are ignored because "
            "--model_config_file is set") in err
    assert err[-1] == "tokenserve serve: error: model 'm' needs a base_path"


def test_grpc_channel_arguments():
    from tokenserve.server.tfserving.grpc_service import channel_options

    options = channel_options("grpc.max_concurrent_streams=10, grpc.primary_user_agent=x")
    assert ("grpc.max_concurrent_streams", 10) in options
    assert ("grpc.primary_user_agent", "x") in options
    assert ("grpc.max_receive_message_length", -1) in options  # TF Serving: no limit


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as raised:
        parse("--version")
    assert raised.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("TensorFlow ModelServer: tokenserve ")
    assert out[1].startswith("TensorFlow Library: 2.")
