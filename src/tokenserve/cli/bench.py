"""`tokenserve bench`: load-test an OpenAI-compatible server; flags follow `vllm bench serve`."""

from __future__ import annotations

import argparse
import math


def _rate(text: str) -> float:
    rate = float(text)  # accepts "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate


def add_parser(commands) -> None:
    p = commands.add_parser(
        "bench", help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description="Sends streaming requests to an OpenAI-compatible endpoint (tokenserve or "
                    "any other) and reports TTFT, TPOT, ITL and E2E latency percentiles, "
                    "request and token throughput and goodput, with the definitions of "
                    "`vllm bench serve`. Writes results.json, latency_cdf.png and "
                    "throughput_vs_rate.png to --result-dir.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (default: %(default)s)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: first in /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY if set)")
    p.add_argument("--dataset-name", choices=("random", "file", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None,
                   help="prompt file (one per line, or JSON lines with 'prompt') or ShareGPT JSON")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--output-len", type=int, default=None,
                   help="max_tokens for file and sharegpt prompts (file default 128; "
                        "sharegpt default: the reply's length)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json used to size prompts (default: the built-in one)")
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[math.inf],
                   help="requests/s, inf = all at once; several values run a sweep")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="1 = Poisson arrivals; <1 burstier, >1 more even (gamma)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el)")
    p.add_argument("--percentiles", default="50,95,99",
                   help="comma-separated (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly max_tokens (vLLM extension)")
    sampling = p.add_argument_group("sampling (sent with every request)")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 (the default) is greedy")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None,
                          help="vLLM's extension of the OpenAI API, as --min-p")
    sampling.add_argument("--min-p", type=float, default=None)
    p.add_argument("--label", default=None,
                   help="name of this server/configuration in results and comparisons "
                        "(default: the model name)")
    p.add_argument("--compare", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="run nothing: show earlier results.json files side by side and "
                        "plot them together into --result-dir")
    p.add_argument("--result-dir", default="bench-results")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(run=run, loads_tensorflow=False)  # an HTTP client: no TensorFlow


def _dataset(args: argparse.Namespace, tokenizer):
    from tokenserve.bench import dataset

    if args.dataset_name == "random":
        return dataset.random_dataset(args.num_prompts, args.random_input_len,
                                      args.random_output_len, args.random_range_ratio,
                                      args.seed, tokenizer)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "file":
        return dataset.file_dataset(args.dataset_path, args.num_prompts, args.output_len or 128,
                                    args.seed, tokenizer)
    return dataset.sharegpt_dataset(args.dataset_path, args.num_prompts, args.seed, tokenizer,
                                    args.output_len)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        return _compare(args)
    return _benchmark(args)


def _write_plots(result_dir, runs: list[dict]) -> list:
    from tokenserve.bench import plots

    return [plots.plot_latency_cdfs(result_dir / "latency_cdf.png", runs),
            plots.plot_throughput_vs_rate(result_dir / "throughput_vs_rate.png", runs)]


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenserve.bench import report
    from tokenserve.errors import ConfigError

    try:
        runs = report.load_runs(args.compare)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"cannot read results: {error}") from None
    report.print_table(runs)
    paths = _write_plots(Path(args.result_dir), runs)
    print("wrote " + ", ".join(str(path) for path in paths))
    return 0


def _benchmark(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import os
    from pathlib import Path

    import httpx

    from tokenserve.bench import report
    from tokenserve.bench.client import ClientConfig
    from tokenserve.bench.dataset import load_tokenizer
    from tokenserve.bench.metrics import parse_goodput
    from tokenserve.bench.run import SweepConfig, resolve_model, run_sweep
    from tokenserve.errors import ConfigError

    try:
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        tokenizer = load_tokenizer(args.tokenizer)
        requests = _dataset(args, tokenizer)
        sweep = SweepConfig(request_rates=tuple(args.request_rate), burstiness=args.burstiness,
                            max_concurrency=args.max_concurrency, seed=args.seed,
                            percentiles=tuple(float(p) for p in args.percentiles.split(",")),
                            goodput_slos_ms=parse_goodput(args.goodput),
                            show_progress=not args.disable_tqdm)
    except (ValueError, OSError) as error:
        raise ConfigError(str(error)) from None
    client = ClientConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                          api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                          ignore_eos=args.ignore_eos, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    try:
        client = dataclasses.replace(client, model=asyncio.run(resolve_model(client)))
    except (httpx.HTTPError, ValueError) as error:
        raise ConfigError(f"cannot list models at {args.base_url}/v1/models: {error}") from None

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    results = asyncio.run(run_sweep(client, requests, sweep, count_tokens))
    label = args.label or client.model
    runs = [report.run_to_json(result, label) for result in results]
    report.print_table(runs)
    result_dir = Path(args.result_dir)
    settings = {key: value for key, value in vars(args).items()
                if key not in ("run", "api_key", "compare")}
    settings.update(model=client.model, label=label,
                    request_rate=["inf" if math.isinf(r) else r for r in args.request_rate])
    paths = [report.write_json(result_dir / "results.json", settings, runs),
             *_write_plots(result_dir, runs)]
    print("wrote " + ", ".join(str(path) for path in paths))
    failed = sum(run["failed"] for run in runs)
    if failed:
        first_error = next(error for run in runs for error in run["errors"] if error)
        print(f"{failed} request(s) failed; first error: {first_error}")
    # Exit 1 when nothing succeeded, so scripts notice a wrong URL, model or key.
    return 1 if all(run["completed"] == 0 for run in runs) else 0
