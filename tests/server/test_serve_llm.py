"""`tokenserve serve` as users run it: one process with the engine behind the OpenAI API, the
streaming gRPC service and TF Serving's REST API, API keys on all of them, and a hot swap
that lets a running generation stream finish on the old version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from support.servables import free_port

KEY = "sk-serve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    import dataclasses

    from tokenserve.config import GenerationConfig, preset
    from tokenserve.export.exporter import export_model
    from tokenserve.model import build_model

    base = tmp_path_factory.mktemp("served") / "tiny"
    # a long context, so one request can stream long enough to outlive a version swap
    architecture = dataclasses.replace(preset("tiny-gpt2"), max_seq_len=1024)
    model = build_model(architecture, seed=0)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="tiny")
    export_model(model, tokenizer, config, base, jit_compile=False)
    ports = {name: free_port() for name in ("grpc", "rest", "openai")}
    log = open(base.parent / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenserve", "serve", f"--port={ports['grpc']}",
         f"--rest_api_port={ports['rest']}", f"--openai_port={ports['openai']}",
         "--model_name=tiny", f"--model_base_path={base}", "--file_system_poll_wait_seconds=1",
         f"--api_key={KEY}", "--precision=float32", "--max_num_seqs=8",
         "--num_speculative_tokens=3", "--graceful_shutdown_seconds=2"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    openai_url = f"http://127.0.0.1:{ports['openai']}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, (base.parent / "server.log").read_text()
        try:
            if httpx.get(openai_url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    yield {"base": base, "openai": openai_url, "rest": f"http://127.0.0.1:{ports['rest']}",
           "grpc": f"127.0.0.1:{ports['grpc']}", "process": process}
    process.terminate()
    process.wait(timeout=30)


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server["openai"] + "/v1", api_key=KEY, max_retries=0)


def test_openai_completion_and_usage_through_serve(server):
    completion = openai_client(server).completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=8, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"
    assert httpx.get(server["openai"] + "/metrics").status_code == 401  # follows --api_key
    metrics = httpx.get(server["openai"] + "/metrics", headers=AUTH).text
    assert 'vllm:generation_tokens_total{model_name="tiny"' in metrics


def test_drafting_server_streams_plain_decodings_greedy_tokens(server):
    """The server runs with --num_speculative_tokens: a greedy stream comes out several
    tokens per delta at times, and is the text of plain decoding offline."""
    from tokenserve import LLM, SamplingParams

    prompt, max_tokens = "class Point:\n    def", 48
    plain = LLM(server["base"] / "1", precision="float32", max_num_seqs=4).generate(
        prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
    chunks = list(openai_client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.outputs[0].text
    assert chunks[-1].usage.completion_tokens == max_tokens
    drafted, accepted = spec_counters(server)
    assert drafted >= accepted > 0


def spec_counters(server) -> tuple[float, float]:
    """The server's (drafted, accepted) token counters."""
    drafted = accepted = 0.0
    for line in httpx.get(server["openai"] + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith("vllm:spec_decode_num_draft_tokens_total{"):
            drafted += float(line.rsplit(" ", 1)[1])
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total{"):
            accepted += float(line.rsplit(" ", 1)[1])
    return drafted, accepted


def test_drafting_server_samples_seeded_requests_as_without_drafts(server):
    """Sampled requests draft only without a seed: a seeded stream is the seeded offline
    decoding's text, and unseeded ones (n = 2, logprobs) stream whole answers while the
    server checks drafts for them."""
    from tokenserve import LLM, SamplingParams

    prompt, max_tokens = "for i in range(10):\n    for j in range(10):\n        ", 40
    client = openai_client(server)
    offline = LLM(server["base"] / "1", precision="float32", max_num_seqs=4).generate(
        prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8,
                               seed=7), use_tqdm=False)[0]
    before = spec_counters(server)
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0.8,
        seed=7, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.outputs[0].text
    assert spec_counters(server) == before
    # top_k=1: a tiny random model's distribution is nearly flat, so at any real
    # temperature whether a drawn word recurs (and a draft is made) would be chance
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0.2,
        n=2, logprobs=1, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "top_k": 1}))
    assert chunks[-1].usage.completion_tokens == 2 * max_tokens
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    for index in (0, 1):
        tokens = [t for c in chunks for choice in c.choices if choice.index == index
                  for t in choice.logprobs.tokens]
        assert len(tokens) == max_tokens
        assert "".join(tokens) == greedy.choices[0].text
    assert spec_counters(server)[0] > before[0]


def test_every_frontend_requires_the_key_and_health_stays_open(server):
    import openai

    no_key = openai.OpenAI(base_url=server["openai"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.completions.create(model="tiny", prompt="x", max_tokens=2)
    body = {"instances": [[5, 6, 7]]}
    url = server["rest"] + "/v1/models/tiny:predict"
    refused = httpx.post(url, json=body)
    assert refused.status_code == 401 and "error" in refused.json()
    assert httpx.post(url, json=body, headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(server["openai"] + "/health").status_code == 200

    from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc

    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "tiny"
        with pytest.raises(grpc.RpcError) as error:
            stub.GetModelStatus(request)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = stub.GetModelStatus(request, metadata=[("authorization", f"Bearer {KEY}")])
        assert status.model_version_status[0].state == \
            get_model_status_pb2.ModelVersionStatus.State.Value("AVAILABLE")


def test_streaming_grpc_generation_through_serve(server):
    from tokenserve.server.proto.tokenserve import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            model="tiny", text="import os",
            sampling=generation_pb2.SamplingOptions(max_tokens=6, ignore_eos=True))
        responses = list(stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")]))
    tokens = [t for r in responses for o in r.outputs for t in o.token_ids]
    assert len(tokens) == 6 and responses[-1].finished
    assert responses[-1].usage.completion_tokens == 6


def test_one_seed_gives_the_same_tokens_on_the_cli_offline_and_through_the_server(server):
    """One host sampler (docs/architecture.md#one-host-sampler): `tokenserve generate` (the
    export's own signatures), the offline `LLM` and the server's engine all pick tokens with
    the engine's sampler, so a seeded, sampled (not greedy) request gives the same text."""
    from tokenserve import LLM, SamplingParams
    from tokenserve.tools.generate import ExportedModel

    prompt, max_tokens, sampled = "def add(a, b):", 24, dict(temperature=1.0, top_p=0.9, seed=7)
    version_dir = server["base"] / "1"
    cli = subprocess.run(
        [sys.executable, "-m", "tokenserve", "generate", prompt, "--model", str(version_dir),
         "--max-tokens", str(max_tokens), "--temperature", "1.0", "--top-p", "0.9",
         "--seed", "7"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(prompt) and cli.stdout.endswith("\n")
    cli_text = cli.stdout[len(prompt):-1]

    params = SamplingParams(max_tokens=max_tokens, **sampled)
    offline = LLM(version_dir, precision="float32", max_num_seqs=4).generate(
        prompt, params, use_tqdm=False)[0].outputs[0]
    exported = ExportedModel(version_dir)
    streamed_ids = list(exported.stream(exported.tokenizer.encode(prompt), params))
    served = openai_client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, **sampled).choices[0].text

    assert streamed_ids[:len(offline.token_ids)] == list(offline.token_ids)
    assert len(set(offline.token_ids)) > 3  # sampled, not one repeated token
    assert cli_text == offline.text == served


def test_a_repeated_prompt_reports_its_cached_tokens_as_openai_does(server):
    """usage.prompt_tokens_details.cached_tokens (completions and chat, streamed usage too)
    and usage.input_tokens_details.cached_tokens (responses): the prompt tokens the prefix
    cache served, in whole 16-token blocks, read by the official client."""
    client = openai_client(server)
    prompt = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n" * 3
    short = dict(max_tokens=2, extra_body={"ignore_eos": True})

    def completion_cached() -> int:
        usage = client.completions.create(model="tiny", prompt=prompt, **short).usage
        assert usage.prompt_tokens > 16
        return usage.prompt_tokens_details.cached_tokens

    def streamed_completion_cached() -> int:
        chunks = list(client.completions.create(
            model="tiny", prompt=prompt, stream=True,
            stream_options={"include_usage": True}, **short))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens

    def chat_cached(stream: bool) -> int:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            return client.chat.completions.create(
                model="tiny", messages=messages, **short).usage.prompt_tokens_details \
                .cached_tokens
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, stream=True,
            stream_options={"include_usage": True}, **short))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens

    def response_cached() -> int:
        reply = client.responses.create(model="tiny", input=prompt, max_output_tokens=2,
                                        temperature=0)
        return reply.usage.input_tokens_details.cached_tokens

    for cached in (completion_cached, streamed_completion_cached, lambda: chat_cached(False),
                   lambda: chat_cached(True), response_cached):
        cached()  # the first call fills the cache (or finds it filled by the one before)
        again = cached()
        assert again > 0 and again % 16 == 0, again


def test_hot_swap_lets_a_running_stream_finish_on_the_old_version(server):
    """A stream on version 1 keeps its version while version 2 loads and takes new requests;
    version 1 ends only after the stream has finished."""
    from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc

    State = get_model_status_pb2.ModelVersionStatus.State
    AVAILABLE, END = State.Value("AVAILABLE"), State.Value("END")

    def states():
        with grpc.insecure_channel(server["grpc"]) as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            request = get_model_status_pb2.GetModelStatusRequest()
            request.model_spec.name = "tiny"
            reply = stub.GetModelStatus(request, metadata=[("authorization", f"Bearer {KEY}")])
        return {s.version: s.state for s in reply.model_version_status}

    client = openai_client(server)
    # 16 x 1000 tokens with 20 logprobs each is ~25 MB of SSE: more than the socket buffers
    # hold, so while this client does not read, the server's stream is still running
    stream = client.completions.create(model="tiny", prompt="for item in items:",
                                       max_tokens=1000, n=16, logprobs=20, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(stream)]  # the request is running on version 1
    staging = server["base"] / "staging"
    shutil.copytree(server["base"] / "1", staging)
    staging.rename(server["base"] / "2")  # appears whole, as a new version should
    deadline = time.monotonic() + 60
    while states().get(2) != AVAILABLE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert states()[2] == AVAILABLE, "version 2 did not become AVAILABLE"
    assert states()[1] != END, "version 1 ended while its stream was still running"
    def served_by(version: int) -> float:
        metrics = httpx.get(server["openai"] + "/metrics", headers=AUTH).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("vllm:request_success_total{")
                   and 'model_name="tiny"' in line and f'model_version="{version}"' in line)

    before = served_by(2), served_by(1)
    fresh = client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                      extra_body={"ignore_eos": True})
    assert fresh.model == "tiny"
    # the new request ran on version 2's engine, not on version 1 (still streaming)
    assert (served_by(2), served_by(1)) == (before[0] + 1, before[1])
    chunks += list(stream)
    finished = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 16 and {c.finish_reason for c in finished} == {"length"}
    deadline = time.monotonic() + 30
    while states().get(1, END) != END and time.monotonic() < deadline:
        time.sleep(0.2)
    assert states().get(1, END) == END  # END (or already forgotten)
    assert {m.id for m in client.models.list().data} >= {"tiny", "tiny:2"}
    # the lifecycle metrics saw the real load, swap and unload
    metrics = httpx.get(server["openai"] + "/metrics", headers=AUTH).text
    for version, state in (("1", "END"), ("2", "AVAILABLE")):
        assert (f'tokenserve:model_version_state{{model_name="tiny",model_version="{version}",'
                f'state="{state}"}} 1.0') in metrics
    for version in ("1", "2"):
        for series in ("model_load_latency_seconds", "model_warmup_latency_seconds"):
            assert (f'tokenserve:{series}_count{{model_name="tiny",'
                    f'model_version="{version}"}} 1.0') in metrics
    assert 'vllm:num_requests_running{model_name="tiny",model_version="2"}' in metrics
    assert 'vllm:num_requests_running{model_name="tiny",model_version="1"}' not in metrics


def test_made_up_model_names_stay_out_of_the_metrics(server):
    import openai

    client = openai_client(server)
    for name in ("evil-1", "evil-2" + "x" * 2000):
        reply = httpx.post(server["rest"] + f"/v1/models/{name}:predict",
                           json={"instances": [[5, 6]]}, headers=AUTH)
        assert reply.status_code == 404
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="x", max_tokens=1)
    metrics = httpx.get(server["openai"] + "/metrics", headers=AUTH).text
    assert "evil" not in metrics
    assert 'model_name="(unknown)"' in metrics


def test_shutdown_is_not_held_up_by_a_client_that_stopped_reading(server):
    """Last in this module: it stops the server. A stream whose client reads nothing more
    (its socket buffers full) is cancelled after the graceful period; SIGTERM ends the
    process instead of waiting on it forever."""
    client = openai_client(server)
    stream = client.completions.create(model="tiny", prompt="for item in items:",
                                       max_tokens=1000, n=16, logprobs=20, stream=True,
                                       extra_body={"ignore_eos": True})
    next(stream)  # running, and never read again
    started = time.monotonic()
    server["process"].terminate()
    server["process"].wait(timeout=90)
    assert time.monotonic() - started < 45  # the 2 s grace, then the drain
    stream.close()
