"""tokenserve.v1.GenerationService with the generated client against a real server process."""

from __future__ import annotations

import grpc
import openai
import pytest

from support.openai_harness import API_KEY, MODEL, shared_server
from support.waiting import wait_until
from tokenserve.server.proto.tokenserve import generation_pb2 as pb
from tokenserve.server.proto.tokenserve import generation_pb2_grpc as pb_grpc

PROMPT = "def add(a, b):"
AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def server(pytestconfig, tmp_path_factory):
    return shared_server(pytestconfig, tmp_path_factory)


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.grpc_target)
    yield pb_grpc.GenerationServiceStub(channel)
    channel.close()


def generate(stub, **fields) -> list[pb.GenerateResponse]:
    sampling = pb.SamplingOptions(**fields.pop("sampling", {}))
    request = pb.GenerateRequest(model=fields.pop("model", MODEL), sampling=sampling, **fields)
    return list(stub.Generate(request, metadata=AUTH, timeout=60))


def test_streamed_text_matches_the_openai_frontend(stub, server):
    responses = generate(stub, text=PROMPT,
                         sampling={"max_tokens": 10, "ignore_eos": True})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    expected = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert "".join(d.text for r in responses for d in r.outputs) == expected
    assert sum(len(d.token_ids) for r in responses for d in r.outputs) == 10
    assert len(responses) > 1  # streamed, not one message at the end
    first, last = responses[0], responses[-1]
    assert list(first.prompt_token_ids) and not list(last.prompt_token_ids)
    assert last.finished and not any(r.finished for r in responses[:-1])
    assert last.outputs[-1].finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        len(first.prompt_token_ids), 10)
    assert last.usage.total_tokens == len(first.prompt_token_ids) + 10


def test_token_id_prompt_equals_text_prompt(stub):
    by_text = generate(stub, text=PROMPT, sampling={"max_tokens": 6, "ignore_eos": True})
    ids = list(by_text[0].prompt_token_ids)
    by_ids = generate(stub, token_ids=pb.TokenIds(ids=ids),
                      sampling={"max_tokens": 6, "ignore_eos": True})
    tokens = [[t for r in rs for d in r.outputs for t in d.token_ids] for rs in (by_text, by_ids)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_n2_with_logprobs_and_a_model_label(stub):
    responses = generate(stub, model="tiny@stable", text=PROMPT, request_id="my-id-1",
                         sampling={"max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 9,
                                   "logprobs": 2, "ignore_eos": True})
    assert {r.request_id for r in responses} == {"my-id-1"}
    deltas = [d for r in responses for d in r.outputs]
    assert {d.index for d in deltas} == {0, 1}
    entries = [e for d in deltas for e in d.logprobs]
    assert len(entries) == 10
    assert all(len(e.top) == 2 and e.logprob <= 0 for e in entries)
    assert responses[-1].usage.completion_tokens == 10


def test_stop_string_is_reported(stub):
    free = "".join(d.text for r in generate(stub, text=PROMPT, sampling={
        "max_tokens": 30, "ignore_eos": True}) for d in r.outputs)
    start = next(i for i in range(1, len(free) - 1)
                 if free[i:i + 2].isprintable() and "\ufffd" not in free[i:i + 2])
    stop = free[start:start + 2]
    responses = generate(stub, text=PROMPT, sampling={"max_tokens": 30, "ignore_eos": True,
                                                      "stop": [stop]})
    assert "".join(d.text for r in responses for d in r.outputs) == free[:free.index(stop)]
    last = responses[-1].outputs[-1]
    assert (last.finish_reason, last.stop_string) == ("stop", stop)


def test_cancelling_the_call_aborts_the_request(stub, server):
    aborted_before = server.num_finished("abort")
    call = stub.Generate(pb.GenerateRequest(
        model=MODEL, text=PROMPT, sampling=pb.SamplingOptions(max_tokens=110, ignore_eos=True)),
        metadata=AUTH, timeout=60)
    first = next(call)
    assert not first.finished
    call.cancel()
    assert wait_until(lambda: server.num_unfinished() == 0)
    assert wait_until(lambda: server.num_finished("abort") == aborted_before + 1)


def test_a_passed_grpc_deadline_aborts_the_request(stub, server):
    aborted_before = server.num_finished("abort")
    request = pb.GenerateRequest(model=MODEL, text=PROMPT,
                                 sampling=pb.SamplingOptions(max_tokens=110, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, metadata=AUTH, timeout=0.05))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: server.num_unfinished() == 0)
    assert wait_until(lambda: server.num_finished("abort") == aborted_before + 1)
