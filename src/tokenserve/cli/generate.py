"""`tokenserve generate "PROMPT"`: stream a completion from an exported SavedModel."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="stream a completion to the terminal",
                            description="Generates from an exported SavedModel, printing tokens "
                                        "as they are produced. Without --model it uses the "
                                        "built-in model (exported once into ~/.cache).")
    p.add_argument("prompt", help="text to continue")
    p.add_argument("--model", default=None,
                   help="SavedModel version dir or base path (newest version), a .tflite "
                        "export (file, version dir or base path; runs through LiteRT), builtin, "
                        "builtin-lstm or smollm2 (exported once into ~/.cache); default: "
                        "built-in")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stats", action="store_true", help="print timing to stderr at the end")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import time

    from tokenserve.edge.runner import is_tflite_path
    from tokenserve.export.cached_exports import builtin_export
    from tokenserve.sampling import SamplingParams
    from tokenserve.tools.evaluate import resolve_model_path
    from tokenserve.tools.generate import ExportedModel

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    path = resolve_model_path(args.model) if args.model else builtin_export()
    if is_tflite_path(path):  # through LiteRT, as a phone runs it
        from tokenserve.edge.runner import LiteRTModel

        model = LiteRTModel(path)
    else:
        model = ExportedModel(path)
    encode = getattr(model.tokenizer, "encode_prompts", None)  # LiteRT's tokenizer lacks it
    prompt_ids = encode([args.prompt])[0] if encode else model.tokenizer.encode(args.prompt)
    model.check_fits(len(prompt_ids), params.max_tokens)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    started = time.perf_counter()
    first = None
    tokens = []

    def timed():
        nonlocal first
        for token in model.stream(prompt_ids, params):
            first = first or time.perf_counter()
            tokens.append(token)
            yield token

    for piece in model.tokenizer.stream(timed()):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats and tokens:
        elapsed = time.perf_counter() - started
        decode_rate = (len(tokens) - 1) / max(time.perf_counter() - first, 1e-9)
        print(f"[{len(prompt_ids)} prompt tokens, {len(tokens)} generated, "
              f"TTFT {1000 * (first - started):.0f} ms, {decode_rate:.1f} tok/s decode, "
              f"{elapsed:.2f}s total]", file=sys.stderr)
    return 0
