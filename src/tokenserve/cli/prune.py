"""`tokenserve prune SOURCE --output BASE --heads 0.25 [--mlp 0.2] [--finetune-steps N]`.

The pruned model is exported only when its held-out perplexity stays within
`--max-perplexity-increase` of its source's (train/prune_gate.py); `--force` exports it
anyway, and the figures go into the export's `assets.extra/prune_report.json` either way.
"""

from __future__ import annotations

import argparse

from tokenserve.tools.optimize import GATE_PERCENT
from tokenserve.train.finetune import DATA_HELDOUT_SHARE, FINETUNE_LEARNING_RATE
from tokenserve.train.prune_gate import GATE_CONTEXT, GATE_TOKENS


def add_parser(commands) -> None:
    p = commands.add_parser(
        "prune", help="remove attention heads and MLP channels; export a smaller SavedModel",
        description="Scores attention heads (by KV group) and MLP channels on calibration "
                    "windows, removes the least important from every layer so the matrices "
                    "shrink, optionally fine-tunes briefly, and exports a versioned SavedModel "
                    "the engine serves, once its held-out perplexity is within "
                    "--max-perplexity-increase of the source's. SOURCE is an exported model "
                    "(version dir or base path) or anything `tokenserve export` takes "
                    "(default: builtin).")
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
                   help="UTF-8 text for scoring and fine-tuning, its last "
                        f"{DATA_HELDOUT_SHARE * 100:g} %% held out for the perplexity gate "
                        "(default: "
                        "the built-in models' training split of the standard library, and "
                        "their held-out split for the gate; repeatable)")
    p.add_argument("--calibration-windows", type=int, default=32, metavar="N",
                   help="windows scored per head group (default 32; with --window, 8k tokens "
                        "pick better heads to drop than 2k)")
    p.add_argument("--window", type=int, default=256, metavar="T",
                   help="tokens per calibration window (default 256)")
    p.add_argument("--max-perplexity-increase", "--max_perplexity_increase", type=float,
                   default=GATE_PERCENT, metavar="PERCENT",
                   help="refuse to export when the pruned model's held-out perplexity is more "
                        "than this many percent above the source's (default %(default)g)")
    p.add_argument("--eval-tokens", type=int, default=GATE_TOKENS, metavar="N",
                   help=f"held-out tokens the gate scores, in windows of up to {GATE_CONTEXT} "
                        "tokens (default %(default)d)")
    p.add_argument("--force", action="store_true",
                   help="export even past --max-perplexity-increase (the figures are "
                        "recorded in assets.extra/prune_report.json)")
    p.add_argument("--version", type=int, default=None, help="version number (default: next)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    import sys
    import tempfile
    import time
    from pathlib import Path

    from tokenserve.cli.output import prepare_output_dir
    from tokenserve.errors import ConfigError
    from tokenserve.export.exporter import export_model
    from tokenserve.model.prune import PruneConfig, prune_model
    from tokenserve.tools.evaluate import load_float_source
    from tokenserve.train.finetune import calibration_windows, finetune, training_streams
    from tokenserve.train.prune_gate import GateConfig, check_pruned

    started = time.perf_counter()
    if args.finetune_steps < 0:
        raise ConfigError(f"--finetune-steps must not be negative, got {args.finetune_steps}")
    prune_config = PruneConfig(heads=args.heads, mlp=args.mlp)
    gate_config = GateConfig(max_increase_percent=args.max_perplexity_increase,
                             max_tokens=args.eval_tokens)
    output = Path(args.output)
    output_existed = output.exists()
    prepare_output_dir(output)  # before pruning: a bad path fails in a second
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
    held_out = (f"the last {DATA_HELDOUT_SHARE * 100:g} % of --data" if args.data
                else "the built-in held-out split")
    gate = check_pruned(model, pruned, holdout, held_out, gate_config)
    print(gate.summary())
    if not gate.passed and not args.force:
        print(f"tokenserve prune: {gate.refusal(args.finetune_steps)}", file=sys.stderr)
        if not output_existed and not any(output.iterdir()):
            output.rmdir()  # made for this export, which is not written
        return 1
    config = dataclasses.replace(config, model=pruned.config)
    path = export_model(pruned, tokenizer, config, output, version=args.version)
    (path / "assets.extra").mkdir(exist_ok=True)
    (path / "assets.extra" / "prune_report.json").write_text(
        json.dumps(dict(report.to_dict(), heads=args.heads, mlp=args.mlp,
                        finetune_steps=args.finetune_steps,
                        distill=bool(args.finetune_steps and args.distill),
                        perplexity=dict(gate.to_dict(), forced=not gate.passed)),
                   indent=2) + "\n")
    if not gate.passed:
        print(f"tokenserve prune: exported past the +{gate.max_increase_percent:g} % perplexity "
              f"limit (--force)", file=sys.stderr)
    c = pruned.config
    print(f"pruned {config.name}: {c.num_heads} query / {c.num_kv_heads} KV heads of "
          f"{model.config.num_heads} / {model.config.num_kv_heads}, MLP "
          f"{c.intermediate_size} of {model.config.intermediate_size}; "
          f"{report.parameters_after:,} of {report.parameters_before:,} parameters; "
          f"exported to {path} in {time.perf_counter() - started:.1f}s")
    return 0
