"""`tokenserve optimize SOURCE --output DIR`: every size/speed variant, measured and gated."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    from tokenserve.tools.optimize import VARIANTS

    p = commands.add_parser(
        "optimize", help="build and measure fp32/bf16/int8/TFLite/pruned variants of a model",
        description="Exports every variant of SOURCE under DIR/models/, measures file size, "
                    "held-out perplexity and its change from fp32, greedy agreement, batch-1 "
                    "decode tok/s and time to first token, and writes DIR/optimize.{json,md,png}. "
                    "Variants whose perplexity rises more than 5 % are marked rejected.")
    p.add_argument("source", nargs="?", default=None,
                   help="what to optimize: builtin (default), an export dir, or any "
                        "`tokenserve export` SOURCE")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--eval-tokens", type=int, default=8192, metavar="N",
                   help="held-out tokens scored per variant (default 8192)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="tokens generated per speed run (default 128)")
    p.add_argument("--finetune-steps", type=int, default=300, metavar="N",
                   help="distilled fine-tune steps of the pruned-heads25-ft variant "
                        "(default 300)")
    p.add_argument("--calibration-windows", type=int, default=32, metavar="N",
                   help="256-token windows the pruned variants score heads on (default 32)")
    p.add_argument("--reuse", action="store_true",
                   help="measure again the variants an earlier run built in DIR (its "
                        "optimize.json), building only the missing ones")
    p.add_argument("--no-engine", dest="engine", action="store_false",
                   help="skip the engine's tok/s for SavedModel variants")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os
    import platform
    import sys
    from pathlib import Path

    from tokenserve.errors import ConfigError
    from tokenserve.tools.optimize import VARIANTS, Optimizer, print_table, write_report

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    from tokenserve.cli.output import prepare_output_dir

    prepare_output_dir(args.output)
    optimizer = Optimizer(args.source, Path(args.output), eval_tokens=args.eval_tokens,
                          max_tokens=args.max_tokens, finetune_steps=args.finetune_steps,
                          calibration_windows=args.calibration_windows,
                          progress=sys.stderr.isatty(), variants=variants, engine=args.engine,
                          reuse=args.reuse)
    results = optimizer.run()
    title = f"tokenserve optimize {optimizer.source}"
    from tokenserve.host.cpu_flags import cpu_flags

    meta = {"source": optimizer.source, "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(),
            "eval_tokens": args.eval_tokens, "max_tokens": args.max_tokens,
            "finetune_steps": args.finetune_steps,
            "calibration_windows": args.calibration_windows,
            "description": f"Held-out perplexity over {args.eval_tokens} tokens of the "
                           f"built-in held-out split; speed: batch 1, {args.max_tokens} "
                           f"generated tokens after a 64-token prompt, best of 2."}
    write_report(results, Path(args.output), title, meta)
    print_table(results, title)
    return 0
