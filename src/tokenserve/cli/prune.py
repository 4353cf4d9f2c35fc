"""`tokenserve prune SOURCE --output BASE --heads 0.25 [--mlp 0.2] [--finetune-steps N]`."""

from __future__ import annotations

import argparse

from tokenserve.train.finetune import FINETUNE_LEARNING_RATE


def add_parser(commands) -> None:
    p = commands.add_parser(
        "prune", help="remove attention heads and MLP channels; export a smaller SavedModel",
        description="Scores attention heads (by KV group) and MLP channels on calibration "
                    "windows, removes the least important from every layer so the matrices "
                    "shrink, optionally fine-tunes briefly, and exports a versioned SavedModel "
                    "the engine serves. SOURCE is an exported model (version dir or base "
                    "path) or anything `tokenserve export` takes (default: builtin).")
    p.add_argument("source", nargs="?", default=None, help="what to prune (default: builtin)")
    p.add_argument("--output", required=True, help="model base path; versions go beneath it")
    p.add_argument("--heads", type=float, default=0.25,
                   help="fraction of KV heads (with their query heads) removed per layer "
                        "(default 0.25)")
    p.add_argument("--mlp", type=float, default=0.0,
                   help="fraction of MLP channels removed per layer (default 0)")
    p.add_argument("--finetune-steps", type=int, default=0, metavar="N",
                   help="AdamW steps on the training data after pruning (default 0: none)")
    p.add_argument("--learning-rate", type=float, default=FINETUNE_LEARNING_RATE,
                   help="peak of the fine-tune's warmup-then-cosine schedule (default %(default)g)")
    p.add_argument("--distill", action=argparse.BooleanOptionalAction, default=True,
                   help="fine-tune on the unpruned model's next-token distributions (KL) as "
                        "well as the text (default on; --no-distill: the text alone)")
    p.add_argument("--data", metavar="FILE", action="append", default=None,
                   help="UTF-8 text for scoring and fine-tuning (default: the built-in "
                        "models' training split of the standard library; repeatable)")
    p.add_argument("--calibration-windows", type=int, default=32, metavar="N",
                   help="windows scored per head group (default 32; with --window, 8k tokens "
                        "pick better heads to drop than 2k)")
    p.add_argument("--window", type=int, default=256, metavar="T",
                   help="tokens per calibration window (default 256)")
    p.add_argument("--version", type=int, default=None, help="version number (default: next)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    import sys
    import tempfile
    import time

    from tokenserve.errors import ConfigError
    from tokenserve.export.exporter import export_model
    from tokenserve.tools.evaluate import load_float_source
    from tokenserve.model.prune import PruneConfig, prune_model
    from tokenserve.train.finetune import calibration_windows, finetune, training_streams

    started = time.perf_counter()
    if args.finetune_steps < 0:
        raise ConfigError(f"--finetune-steps must not be negative, got {args.finetune_steps}")
    prune_config = PruneConfig(heads=args.heads, mlp=args.mlp)
    from tokenserve.cli.output import prepare_output_dir

    prepare_output_dir(args.output)  # before pruning: a bad path fails in a second
    model, tokenizer, config = load_float_source(args.source)
    train, holdout = training_streams(tokenizer, args.data)
    windows = calibration_windows(train, args.calibration_windows,
                                  min(args.window, config.max_seq_len), args.seed)
    pruned, report = prune_model(model, windows, prune_config, progress=sys.stderr.isatty())
    if args.finetune_steps:
        with tempfile.TemporaryDirectory(prefix="tokenserve-prune-") as workdir:
            finetune(pruned, train, holdout, args.finetune_steps, workdir,
                     learning_rate=args.learning_rate, seed=args.seed,
                     teacher=model if args.distill else None)
    config = dataclasses.replace(config, model=pruned.config)
    path = export_model(pruned, tokenizer, config, args.output, version=args.version)
    (path / "assets.extra").mkdir(exist_ok=True)
    (path / "assets.extra" / "prune_report.json").write_text(
        json.dumps(dict(report.to_dict(), heads=args.heads, mlp=args.mlp,
                        finetune_steps=args.finetune_steps,
                        distill=bool(args.finetune_steps and args.distill)), indent=2) + "\n")
    c = pruned.config
    print(f"pruned {config.name}: {c.num_heads} query / {c.num_kv_heads} KV heads of "
          f"{model.config.num_heads} / {model.config.num_kv_heads}, MLP "
          f"{c.intermediate_size} of {model.config.intermediate_size}; "
          f"{report.parameters_after:,} of {report.parameters_before:,} parameters; "
          f"exported to {path} in {time.perf_counter() - started:.1f}s")
    return 0
