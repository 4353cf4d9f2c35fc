"""`tokenserve eval MODEL [--data FILE] [--reference OTHER]`: perplexity as a quality gate."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    p = commands.add_parser(
        "eval", help="perplexity of an exported model (held-out stdlib split or your files)",
        description="Scores an exported model the way the engine loads it: next-token "
                    "perplexity over non-overlapping windows of its context length. MODEL is "
                    "a version dir, a base path (newest version), builtin or builtin-lstm. "
                    "Without --data it reads the built-in models' held-out split of this "
                    "interpreter's standard library.")
    p.add_argument("model", metavar="MODEL",
                   help="version dir, base path, builtin, builtin-lstm or smollm2")
    p.add_argument("--data", metavar="FILE", action="append", default=None,
                   help="UTF-8 text file to score instead of the held-out split (repeatable)")
    p.add_argument("--reference", metavar="OTHER_MODEL", default=None,
                   help="also score this model on the same windows; report the perplexity "
                        "change and how often both models' greedy tokens agree")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens the model reads per window (default: its context length)")
    p.add_argument("--max-tokens", type=int, default=32768, metavar="N",
                   help="score at most this many tokens, in windows spread evenly over the "
                        "data (default: 32768)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="windows per forward pass (default: 8; fewer where their float32 "
                        "logits would pass 2 GiB)")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="float32",
                   help="compute dtype (default float32, comparable across machines; auto "
                        "picks bfloat16 on CPUs with AMX or AVX512-BF16)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   default=None,
                   help="score MODEL through the engine's paged step over a KV cache of this "
                        "dtype (its rounding included); with --reference MODEL itself this "
                        "measures the cache's effect")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the numbers here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    import time
    from pathlib import Path

    from tokenserve.errors import ConfigError
    from tokenserve.tools import evaluate

    started = time.perf_counter()
    for name in ("max_tokens", "batch_size", "context"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    texts = evaluate.read_texts(args.data) if args.data else None

    model, tokenizer, config, version_dir = evaluate.load_for_eval(args.model, args.precision)
    reference = None
    context_limit = config.max_seq_len
    if args.reference:
        reference, ref_tokenizer, ref_config, ref_dir = evaluate.load_for_eval(
            args.reference, args.precision)
        if not evaluate.same_tokenizer(tokenizer, ref_tokenizer):
            raise ConfigError(f"{ref_dir} has a different tokenizer from {version_dir}; "
                              f"perplexities over different tokens do not compare")
        context_limit = min(context_limit, ref_config.max_seq_len)
    if args.context is not None and args.context > context_limit:
        raise ConfigError(f"--context {args.context} exceeds the context length of "
                          f"{context_limit} tokens")
    context = args.context or context_limit

    if texts is None:
        windows = evaluate.heldout_windows(tokenizer, context, args.max_tokens)
        data = f"held-out stdlib split ({evaluate.heldout_fraction():.0%} of files)"
    else:
        windows = evaluate.text_windows(texts, tokenizer, context, args.max_tokens)
        data = ", ".join(args.data)
    scored = (evaluate.KVCacheScorer(model, args.kv_cache_dtype) if args.kv_cache_dtype
              else model)
    result = evaluate.perplexity(scored, windows, batch_size=args.batch_size,
                                 reference=reference, progress=sys.stderr.isatty())
    seconds = time.perf_counter() - started

    _print_table(result, version_dir, ref_dir if reference is not None else None, data,
                 model.compute_dtype, seconds)
    if args.json:
        record = {
            "model": str(version_dir), "weight_format": evaluate.weight_format(version_dir),
            "precision": model.compute_dtype, "data": data, "context": result.context,
            "windows": result.num_windows, "tokens": result.num_tokens, "nll": result.nll,
            "perplexity": result.perplexity, "seconds": round(seconds, 2),
            "kv_cache_dtype": scored.kv_dtype if args.kv_cache_dtype else None}
        if reference is not None:
            record.update({
                "reference_model": str(ref_dir),
                "reference_weight_format": evaluate.weight_format(ref_dir),
                "reference_nll": result.reference_nll,
                "reference_perplexity": result.reference_perplexity,
                "delta_percent": result.delta_percent,
                "greedy_agreement": result.greedy_agreement})
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def _print_table(result, version_dir, ref_dir, data, precision, seconds) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, len(str(version_dir)) + 50))
    table = Table(title=f"tokenserve eval: {data}")
    for title in ("model", "tokens", "nll", "perplexity"):
        table.add_column(title, justify="left" if title == "model" else "right")
    table.add_row(str(version_dir), f"{result.num_tokens:,}", f"{result.nll:.4f}",
                  f"{result.perplexity:.3f}")
    if ref_dir is not None:
        table.add_row(f"{ref_dir} (reference)", f"{result.num_tokens:,}",
                      f"{result.reference_nll:.4f}", f"{result.reference_perplexity:.3f}")
    console.print(table)
    console.print(f"scored {result.num_tokens:,} tokens in {result.num_windows} windows of "
                  f"{result.context} ({precision}) in {seconds:.1f}s", highlight=False)
    if ref_dir is not None:
        console.print(f"Δ perplexity {result.delta_percent:+.2f} %  greedy agreement "
                      f"{100 * result.greedy_agreement:.1f} %", highlight=False)
