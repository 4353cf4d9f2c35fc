#!/usr/bin/env python
"""Soak and overload: one `tokenserve serve` on the built-in model, a steady mix of traffic
for a stated time, and the checks that matter for a server left running.

Traffic (open loop, Poisson arrivals at `--rate` requests per second), by share:
  completion          non-streamed /v1/completions                         25 %
  completion-stream   streamed /v1/completions, read to [DONE]              15 %
  chat                non-streamed /v1/chat/completions                     10 %
  chat-stream         streamed /v1/chat/completions, read to [DONE]         10 %
  predict             TF Serving REST :predict on the same model            10 %
  grpc-generate       tokenserve.v1.GenerationService/Generate (gRPC)        5 %
  disconnect          a stream dropped after its first event                10 %
  bad                 malformed, nested, oversized-context, wrong-key,
                      unknown-model, text/plain requests (expect 4xx)       15 %

Recorded: per route the count of 2xx, 4xx, 429, 5xx, hung (no answer within
`--client_timeout_s`, while the server's own deadline is `--request_timeout_s`) and client
errors, with P50/P99 latency; the server process's RSS and open file descriptors every 10 s;
and, once the traffic has drained, the running and waiting request gauges from /metrics.

Passes when: zero 5xx, zero hung requests, zero client errors, bad requests all 4xx, RSS at
the end within 5 % of RSS after warm-up (the first `--warmup_s`), and running = waiting = 0.
Latencies are reported but not judged (the machine may be shared).

Output: a summary, benchmarks/results/soak.json and soak.png (RSS, FDs and request
outcomes over time), each stating the duration and rate used.

Run:  python benchmarks/soak.py --duration 600 [--rate 3] [--output benchmarks/results/soak]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np

from common import RESULTS, machine_info, machine_summary, pyplot, serve, write_json

KEY = "sk-soak"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "builtin"
PROMPTS = ["def read_config(path):", "class LRUCache:", "import os\n", "for item in items:",
           "def fib(n):\n    \"\"\"", "with open(path) as f:", "try:\n    import json"]
MIX = [("completion", 25), ("completion-stream", 15), ("chat", 10), ("chat-stream", 10),
       ("predict", 10), ("grpc-generate", 5), ("disconnect", 10), ("bad", 15)]


class SoakServer:
    """`tokenserve serve` on the built-in model, on free loopback ports, with the soak's
    key, deadline and queue limits; its RSS and open file descriptors from /proc."""

    def __init__(self, args):
        self.server = serve(["--host=127.0.0.1", f"--api_key={KEY}",
                             f"--request_timeout_s={args.request_timeout_s}",
                             f"--max_num_seqs={args.max_num_seqs}",
                             f"--max_queue_requests={args.max_queue_requests}"],
                            "tokenserve-soak-server.log",
                            dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        self.process, self.log_path = self.server.process, self.server.log_path
        self.openai = self.server.url
        self.rest = f"http://127.0.0.1:{self.server.ports['rest']}"
        self.grpc = f"127.0.0.1:{self.server.ports['grpc']}"

    def wait_ready(self, timeout_s: float = 900) -> None:
        self.server.wait_until_serving(timeout_s, path="/ready")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def stop(self) -> None:
        self.server.stop()


def bad_request(rng: random.Random) -> tuple[str, str, dict, bytes]:
    """(name, path, headers, body) of a request the server must refuse with a 4xx."""
    json_headers = {**AUTH, "Content-Type": "application/json"}
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    cases = [
        ("malformed-json", "/v1/completions", json_headers, b'{"model": "builtin", "prompt": '),
        ("deep-nesting", "/v1/chat/completions", json_headers,
         b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
        ("unknown-model", "/v1/completions", json_headers,
         json.dumps({**ok, "model": f"nope-{rng.randrange(10**9)}"}).encode()),
        ("prompt-too-long", "/v1/completions", json_headers,
         json.dumps({**ok, "prompt": "def f():\n    pass\n" * 200_000}).encode()),
        ("wrong-key", "/v1/completions", {"Authorization": "Bearer sk-wrong",
                                          "Content-Type": "application/json"},
         json.dumps(ok).encode()),
        ("text-plain", "/v1/completions", {**AUTH, "Content-Type": "text/plain"},
         json.dumps(ok).encode()),
        ("bad-temperature", "/v1/completions", json_headers,
         json.dumps({**ok, "temperature": -3}).encode()),
    ]
    return cases[rng.randrange(len(cases))]


class Soak:
    def __init__(self, args, server: SoakServer):
        self.args, self.server = args, server
        self.rng = random.Random(args.seed)
        self.outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.timeline: list[dict] = []  # one entry per finished request: t, route, outcome
        self.samples: list[dict] = []
        self.started = 0.0
        self.bad_names: dict[str, int] = defaultdict(int)

    def record(self, route: str, outcome: str, seconds: float) -> None:
        self.outcomes[route][outcome] += 1
        if outcome in ("2xx", "4xx", "429"):
            self.latencies[route].append(seconds)
        self.timeline.append({"t": time.monotonic() - self.started, "route": route,
                              "outcome": outcome})

    @staticmethod
    def classify(status: int) -> str:
        if status == 429:
            return "429"
        return f"{status // 100}xx"

    async def one(self, client: httpx.AsyncClient, route: str) -> None:
        started = time.monotonic()
        try:
            outcome = await asyncio.wait_for(self._send(client, route),
                                             self.args.client_timeout_s)
        except asyncio.TimeoutError:
            outcome = "hung"
        except (httpx.HTTPError, OSError) as error:
            outcome = "client-error"
            print(f"  {route}: {type(error).__name__}: {error}", file=sys.stderr)
        self.record(route, outcome, time.monotonic() - started)

    async def _send(self, client: httpx.AsyncClient, route: str) -> str:
        rng, openai = self.rng, self.server.openai
        prompt = rng.choice(PROMPTS)
        max_tokens = rng.randint(4, self.args.max_tokens)
        if route in ("completion", "completion-stream", "disconnect"):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1000),
                    "stream": route != "completion"}
            return await self._post(client, openai + "/v1/completions", body,
                                    drop_after_first=route == "disconnect")
        if route in ("chat", "chat-stream"):
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "stream": route == "chat-stream",
                    "stream_options": {"include_usage": True} if route == "chat-stream"
                    else None}
            return await self._post(client, openai + "/v1/chat/completions", body)
        if route == "predict":
            ids = [rng.randrange(3, 500) for _ in range(rng.randint(2, 12))]
            response = await client.post(f"{self.server.rest}/v1/models/{MODEL}:predict",
                                         json={"instances": [ids]}, headers=AUTH)
            return self.classify(response.status_code)
        if route == "grpc-generate":
            return await asyncio.to_thread(self._grpc_generate, prompt, max_tokens)
        name, path, headers, content = bad_request(rng)
        self.bad_names[name] += 1
        response = await client.post(openai + path, content=content, headers=headers)
        return self.classify(response.status_code)

    async def _post(self, client, url: str, body: dict, drop_after_first: bool = False) -> str:
        body = {k: v for k, v in body.items() if v is not None}
        if not body.get("stream"):
            response = await client.post(url, json=body, headers=AUTH)
            return self.classify(response.status_code)
        async with client.stream("POST", url, json=body, headers=AUTH) as response:
            if response.status_code != 200:
                await response.aread()
                return self.classify(response.status_code)
            last = ""
            async for line in response.aiter_lines():
                if not line:
                    continue
                if drop_after_first:
                    return "2xx"  # leaving the block closes the connection mid-stream
                last = line
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    print(f"  stream error event: {line}", file=sys.stderr)
                    return "5xx"  # a failure after the stream started (its status was 200)
            return "2xx" if last == "data: [DONE]" else "client-error"

    def _grpc_generate(self, prompt: str, max_tokens: int) -> str:
        import grpc

        from tokenserve.server.proto.tokenserve import generation_pb2 as pb
        from tokenserve.server.proto.tokenserve import generation_pb2_grpc

        with grpc.insecure_channel(self.server.grpc) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(model=MODEL, text=prompt,
                                         sampling=pb.SamplingOptions(max_tokens=max_tokens))
            try:
                responses = list(stub.Generate(request, metadata=[("authorization",
                                                                   f"Bearer {KEY}")],
                                               timeout=self.args.client_timeout_s))
            except grpc.RpcError as error:
                code = error.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return "429"
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.UNAUTHENTICATED):
                    return "4xx"
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return "hung"
                return "5xx"
        return "2xx" if responses and responses[-1].finished else "5xx"

    async def sample(self) -> None:
        while True:
            self.samples.append({"t": time.monotonic() - self.started,
                                 "rss_mb": self.server.rss_mb(),
                                 "open_fds": self.server.open_fds()})
            await asyncio.sleep(self.args.sample_every_s)

    async def run(self) -> None:
        routes, weights = zip(*MIX)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=self.args.client_timeout_s,
                                     limits=limits) as client:
            self.started = time.monotonic()
            sampler = asyncio.create_task(self.sample())
            tasks = []
            while time.monotonic() - self.started < self.args.duration:
                route = self.rng.choices(routes, weights)[0]
                tasks.append(asyncio.create_task(self.one(client, route)))
                await asyncio.sleep(self.rng.expovariate(self.args.rate))
            await asyncio.gather(*tasks)  # each one is bounded by the client timeout
            self.drained_at = time.monotonic() - self.started
            await asyncio.sleep(2 * self.args.sample_every_s)  # RSS after the drain
            sampler.cancel()
            self.samples.append({"t": time.monotonic() - self.started,
                                 "rss_mb": self.server.rss_mb(),
                                 "open_fds": self.server.open_fds()})


def scrape_gauges(server: SoakServer) -> dict[str, float]:
    text = httpx.get(server.openai + "/metrics", headers=AUTH, timeout=30).text
    totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def summarize(soak: Soak, gauges: dict[str, float], args) -> dict:
    routes = {}
    for route, outcomes in sorted(soak.outcomes.items()):
        latencies = soak.latencies[route]
        routes[route] = {
            **{k: outcomes.get(k, 0) for k in ("2xx", "4xx", "429", "5xx", "hung",
                                               "client-error")},
            "p50_s": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
            "p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None}
    totals = {k: sum(r[k] for r in routes.values())
              for k in ("2xx", "4xx", "429", "5xx", "hung", "client-error")}
    after_warmup = [s for s in soak.samples if s["t"] >= args.warmup_s]
    rss_start = after_warmup[0]["rss_mb"] if after_warmup else soak.samples[0]["rss_mb"]
    rss_end = soak.samples[-1]["rss_mb"]
    growth = (rss_end - rss_start) / rss_start
    bad = routes.get("bad", {})
    criteria = {
        "zero 5xx": totals["5xx"] == 0,
        "zero hung requests": totals["hung"] == 0,
        "zero client errors": totals["client-error"] == 0,
        "every bad request refused with a 4xx": bad.get("2xx", 0) == 0,
        "RSS growth after warm-up under 5%": growth < 0.05,
        "running and waiting back to 0": gauges["vllm:num_requests_running"] == 0
        and gauges["vllm:num_requests_waiting"] == 0,
    }
    return {"benchmark": "soak", "duration_s": args.duration, "rate_per_s": args.rate,
            "warmup_s": args.warmup_s, "client_timeout_s": args.client_timeout_s,
            "request_timeout_s": args.request_timeout_s, "max_tokens": args.max_tokens,
            "model": MODEL, "mix": dict(MIX), "requests": sum(totals.values()),
            "drained_at_s": round(soak.drained_at, 1), "totals": totals, "routes": routes,
            "bad_requests_sent": dict(soak.bad_names),
            "rss_mb": {"after_warmup": round(rss_start, 1), "end": round(rss_end, 1),
                       "growth": round(growth, 4)},
            "open_fds": {"after_warmup": after_warmup[0]["open_fds"] if after_warmup else None,
                         "end": soak.samples[-1]["open_fds"]},
            "metrics_at_end": gauges, "criteria": criteria, "passed": all(criteria.values()),
            "samples": soak.samples,
            "machine": {**machine_info(), "loadavg": list(os.getloadavg())}}


def plot(result: dict, timeline: list[dict], path: Path) -> None:
    plt = pyplot()
    samples = result["samples"]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [s["t"] for s in samples]
    top.plot(t, [s["rss_mb"] for s in samples], marker="o")
    top.axvline(result["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    top.set_ylabel("server RSS (MB)")
    top.legend()
    middle.plot(t, [s["open_fds"] for s in samples], marker="o", color="tab:orange")
    middle.set_ylabel("open file descriptors")
    width = 10.0
    edges = np.arange(0, max(e["t"] for e in timeline) + width, width)
    for outcome, color in [("2xx", "tab:green"), ("4xx", "tab:blue"), ("429", "tab:purple"),
                           ("5xx", "tab:red"), ("hung", "black")]:
        times = [e["t"] for e in timeline if e["outcome"] == outcome]
        counts, _ = np.histogram(times, edges)
        bottom.plot(edges[:-1], counts / width, label=outcome, color=color)
    bottom.set_ylabel("finished requests / s")
    bottom.set_xlabel("seconds")
    bottom.legend(ncol=5, fontsize=8)
    verdict = "PASS" if result["passed"] else "FAIL"
    fig.suptitle(f"soak: {result['duration_s']:.0f} s at {result['rate_per_s']} req/s, "
                 f"{result['requests']} requests, {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of traffic (default 600)")
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second")
    parser.add_argument("--warmup_s", type=float, default=None,
                        help="RSS growth is measured from here (default: 20%% of --duration)")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--client_timeout_s", type=float, default=120.0,
                        help="a request with no answer by then counts as hung")
    parser.add_argument("--request_timeout_s", type=float, default=60.0,
                        help="the server's deadline (--request_timeout_s of serve)")
    parser.add_argument("--max_num_seqs", type=int, default=16)
    parser.add_argument("--max_queue_requests", type=int, default=64)
    parser.add_argument("--sample_every_s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS / "soak")
    args = parser.parse_args()
    if args.warmup_s is None:
        args.warmup_s = 0.2 * args.duration
    print(machine_summary(machine_info()))
    server = SoakServer(args)
    print(f"server log: {server.log_path}")
    try:
        server.wait_ready()
        soak = Soak(args, server)
        print(f"soak: {args.duration:.0f} s at {args.rate} req/s against pid "
              f"{server.process.pid} ...", flush=True)
        asyncio.run(soak.run())
        gauges = scrape_gauges(server)
    finally:
        server.stop()
    result = summarize(soak, gauges, args)
    write_json(args.output.with_suffix(".json"), result, indent=1)
    plot(result, soak.timeline, args.output.with_suffix(".png"))
    print(f"duration {args.duration:.0f} s, rate {args.rate}/s, {result['requests']} requests")
    for route, row in result["routes"].items():
        print(f"  {route:18} " + "  ".join(f"{k}={row[k]}" for k in row))
    print(f"RSS {result['rss_mb']}, FDs {result['open_fds']}, at end {gauges}")
    for name, ok in result["criteria"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print("PASS" if result["passed"] else "FAIL")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
