"""`tokenserve bench` end to end against a fake OpenAI-compatible SSE server.

The fake streams `max_tokens` tokens with a known first-token delay; it stands in only for
the client layer (the real tokenserve server is tested against separately).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenserve.cli import bench

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_DELAY_S = 0.005
API_KEY = "secret"
BODIES: list[dict] = []  # every request body the fake server received


def fake_openai_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(request: Request, chat: bool):
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        BODIES.append(body)
        num_tokens = body["max_tokens"]

        async def events():
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            for index in range(num_tokens):
                if index:
                    await asyncio.sleep(TOKEN_DELAY_S)
                piece = f" t{index}"
                choice = {"index": 0, "delta": {"content": piece}} if chat else \
                    {"index": 0, "text": piece}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": 11, "completion_tokens": num_tokens,
                         "total_tokens": 11 + num_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await stream(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await stream(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake_openai_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.run(args)


def test_rate_sweep_reports_every_request(fake_server, tmp_path, capsys):
    result_dir = tmp_path / "results"
    code = run_bench(["--base-url", fake_server, "--api-key", API_KEY, "--num-prompts", "6",
                      "--random-input-len", "8", "--random-output-len", "4",
                      "--request-rate", "inf", "100", "--max-concurrency", "3",
                      "--goodput", "ttft:60000", "--result-dir", str(result_dir),
                      "--disable-tqdm"])
    assert code == 0
    results = json.loads((result_dir / "results.json").read_text())
    assert results["config"]["model"] == "fake-model"  # taken from /v1/models
    assert {run["label"] for run in results["runs"]} == {"fake-model"}
    assert [run["request_rate"] for run in results["runs"]] == ["inf", 100.0]
    for run in results["runs"]:
        assert (run["completed"], run["failed"]) == (6, 0)
        assert run["total_output_tokens"] == 6 * 4  # the server's usage
        assert run["total_input_tokens"] == 6 * 11
        assert run["max_concurrent_requests"] <= 3
        assert min(run["ttfts"]) >= FIRST_TOKEN_DELAY_S
        assert [len(gaps) for gaps in run["itls"]] == [3] * 6
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        for key in ("mean_ttft_ms", "median_tpot_ms", "p50_itl_ms", "p95_e2el_ms",
                    "p99_ttft_ms", "std_e2el_ms", "output_throughput"):
            assert key in run
        assert run["p99_ttft_ms"] >= 1000 * FIRST_TOKEN_DELAY_S
    for name in ("latency_cdf.png", "throughput_vs_rate.png"):
        assert (result_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "P99 TTFT (ms)" in printed and "rate inf" in printed


def test_chat_endpoint(fake_server, tmp_path):
    code = run_bench(["--base-url", fake_server, "--api-key", API_KEY, "--model", "fake-model",
                      "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                      "--random-input-len", "4", "--random-output-len", "3",
                      "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert code == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["completed"] == 2 and run["total_output_tokens"] == 6


def test_sampling_flags_go_with_every_request_and_into_the_results(fake_server, tmp_path):
    BODIES.clear()
    code = run_bench(["--base-url", fake_server, "--api-key", API_KEY, "--model", "fake-model",
                      "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "2",
                      "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40",
                      "--min-p", "0.05", "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert code == 0 and len(BODIES) == 3
    for body in BODIES:
        assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == \
            (0.7, 0.9, 40, 0.05)
    config = json.loads((tmp_path / "results.json").read_text())["config"]
    assert (config["temperature"], config["top_p"], config["top_k"]) == (0.7, 0.9, 40)


def test_rejected_requests_count_as_failed(fake_server, tmp_path, capsys):
    code = run_bench(["--base-url", fake_server, "--api-key", "wrong", "--model", "fake-model",
                      "--num-prompts", "2", "--random-input-len", "4",
                      "--random-output-len", "2", "--result-dir", str(tmp_path),
                      "--disable-tqdm"])
    assert code == 1
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert (run["completed"], run["failed"]) == (0, 2)
    assert run["errors"][0].startswith("HTTP 401")
    assert "first error: HTTP 401" in capsys.readouterr().out


def test_compare_earlier_results_side_by_side(fake_server, tmp_path, capsys):
    for label in ("server-a", "server-b"):
        assert run_bench(["--base-url", fake_server, "--api-key", API_KEY, "--label", label,
                          "--num-prompts", "2", "--random-input-len", "4",
                          "--random-output-len", "2", "--request-rate", "inf", "50",
                          "--result-dir", str(tmp_path / label), "--disable-tqdm"]) == 0
    capsys.readouterr()
    code = run_bench(["--compare", str(tmp_path / "server-a" / "results.json"),
                      str(tmp_path / "server-b" / "results.json"),
                      "--result-dir", str(tmp_path / "compared")])
    assert code == 0
    printed = capsys.readouterr().out
    for column in ("server-a rate inf", "server-a rate 50", "server-b rate inf"):
        assert column in printed
    for name in ("latency_cdf.png", "throughput_vs_rate.png"):
        assert (tmp_path / "compared" / name).read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "compared" / "results.json").exists()


def test_registered_in_the_tokenserve_command(capsys):
    from tokenserve.cli.main import main

    assert main(["bench", "--dataset-name", "file", "--num-prompts", "1"]) == 2
    assert "tokenserve bench: error: --dataset-name file needs --dataset-path" in \
        capsys.readouterr().err


def test_an_error_event_mid_stream_fails_the_request(tmp_path):
    """A stream that sends tokens and then an error event is a failure, not a completion."""
    from tokenserve.bench.client import ClientConfig, StreamingClient
    from tokenserve.bench.dataset import BenchRequest

    def broken_stream(request: httpx.Request) -> httpx.Response:
        body = (b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
                b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def send():
        async with StreamingClient(ClientConfig("http://test", "m"),
                                   transport=httpx.MockTransport(broken_stream)) as client:
            return await client.send(BenchRequest("p", 1, 4))

    output = asyncio.run(send())
    assert not output.success
    assert "engine died" in output.error
