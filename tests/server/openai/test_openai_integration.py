"""The OpenAI-compatible API with the official `openai` client against a real server process
(tiny exported Llama, real AsyncEngine, uvicorn)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from support.openai_harness import API_KEY, MODEL, SLOW_MODEL
from support.waiting import wait_until

PROMPT = "def add(a, b):"
LONG = {"ignore_eos": True}  # random weights: no early eos, so lengths are exact


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def num_prompt_tokens(server, **body) -> int:
    response = httpx.post(server.url + "/tokenize", json={"model": MODEL, **body},
                          headers=server.headers)
    return response.json()["count"]


def test_models_lists_names_versions_and_labels(client):
    models = {m.id: m for m in client.models.list()}
    assert {"tiny", "tiny:1", "tiny@stable", "busy", "busy:1"} <= set(models)
    card = models["tiny@stable"]
    assert (card.object, card.owned_by, card.root) == ("model", "tokenserve", "tiny")
    assert card.created > 0


@pytest.mark.parametrize("model", ["tiny", "tiny:1", "tiny@stable"])
def test_every_model_id_form_generates(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_body=LONG)
    assert out.model == model and out.usage.completion_tokens == 3


def test_completion_streamed_equals_not_streamed_and_reports_usage(client, server):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                      extra_body=LONG)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=LONG))
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == num_prompt_tokens(server, prompt=PROMPT)
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_streamed_equals_not_streamed_and_reports_usage(client, server):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "add two numbers"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           extra_body=LONG)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body=LONG))
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == num_prompt_tokens(server, messages=messages)
    assert whole.usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            stream=True, extra_body=LONG))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_n2_returns_two_indexed_choices_streamed_and_not(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2,
                                      temperature=1.0, seed=3, extra_body=LONG)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
        temperature=1.0, seed=3, stream=True, extra_body=LONG))
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert reasons == {0: "length", 1: "length"}
    assert texts[0] != texts[1]  # each sequence has its own random stream


def test_completion_logprobs_are_consistent(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=3,
                                    extra_body=LONG)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 8
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the top
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_with_logprobs_scores_the_prompt_as_one_forward_pass(client, tmp_path_factory):
    """What lm-evaluation-harness sends to score a continuation (echo, logprobs, the prompt
    as token ids): each prompt token's logprob after the ones before it, the first with
    none, then the generated tokens' as without echo; streamed the same. The reference is
    the exported model's full forward pass in this process."""
    import numpy as np

    from support.openai_harness import tiny_model_dir
    from tokenserve.export.restore import load_language_model

    model, tokenizer, _, _ = load_language_model(tiny_model_dir(tmp_path_factory),
                                                 precision="float32")
    ids = tokenizer.encode(PROMPT + " return a + b")
    logits = model(np.array([ids], np.int32)).numpy()[0].astype(np.float64)
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits.max(-1, keepdims=True)

    options = dict(model=MODEL, prompt=ids, max_tokens=3, logprobs=2, echo=True,
                   temperature=0, extra_body=LONG)
    out = client.completions.create(**options).choices[0]
    plain = client.completions.create(**{**options, "echo": False}).choices[0]
    scored = out.logprobs
    n = len(ids)
    assert out.text == tokenizer.decode(ids) + plain.text
    assert scored.tokens[:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    np.testing.assert_allclose(scored.token_logprobs[1:n],
                               [expected[i - 1, ids[i]] for i in range(1, n)], atol=2e-4)
    for i in range(1, n):  # the two likeliest after each prefix, the chosen one or not
        # (keyed by text: two tokens that decode alike, such as two halves of a character,
        # share one key, so one entry can stand for both)
        best = np.sort(expected[i - 1])[::-1][:2]
        top = sorted(scored.top_logprobs[i].values(), reverse=True)
        assert top[0] == pytest.approx(best[0], abs=2e-4)
        assert all(min(abs(v - best)) < 2e-4 for v in top)
    assert scored.text_offset[:n] == sorted(scored.text_offset[:n]) and scored.text_offset[0] == 0
    # the generated part: exactly what the same request without echo gives
    assert scored.tokens[n:] == plain.logprobs.tokens
    np.testing.assert_allclose(scored.token_logprobs[n:], plain.logprobs.token_logprobs,
                               atol=1e-4)
    assert scored.text_offset[n] == len(tokenizer.decode(ids))
    streamed = list(client.completions.create(stream=True, **options))
    tokens = [t for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for t in chunk.choices[0].logprobs.tokens]
    assert tokens == scored.tokens
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, server):
    """OpenAI's legacy prompt-scoring call: the prompt back with its logprobs, nothing
    generated, finished by length; the same numbers as the prompt part of a generating
    request; streamed as one chunk per choice. Without echo, max_tokens 0 is still a 400."""
    ids = [5, 17, 33, 90, 140, 7, 8, 9]
    options = dict(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    out = client.completions.create(**options)
    generating = client.completions.create(**{**options, "max_tokens": 2}).choices[0]
    choice = out.choices[0]
    assert (choice.finish_reason, out.usage.completion_tokens) == ("length", 0)
    assert out.usage.prompt_tokens == len(ids)
    assert choice.text == generating.text[:len(choice.text)] and choice.text
    assert choice.logprobs.tokens == generating.logprobs.tokens[:len(ids)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        generating.logprobs.token_logprobs[1:len(ids)], abs=1e-5)
    streamed = list(client.completions.create(stream=True, n=2,
                                              stream_options={"include_usage": True},
                                              **options))
    chunks = [c for c in streamed if c.choices]
    assert sorted(c.choices[0].index for c in chunks) == [0, 1]
    assert all(c.choices[0].text == choice.text and c.choices[0].finish_reason == "length"
               and c.choices[0].logprobs.tokens == choice.logprobs.tokens for c in chunks)
    assert streamed[-1].usage.completion_tokens == 0
    unscored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert unscored.choices[0].logprobs is None and unscored.choices[0].text == choice.text
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert server.num_unfinished() == 0


def test_chat_logprobs_have_tokens_bytes_and_alternatives(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        logprobs=True, top_logprobs=2, extra_body=LONG)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8") == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_stop_string_cuts_the_text_and_finishes_with_stop(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30,
                                     extra_body=LONG).choices[0].text
    start = next(i for i in range(1, len(free) - 1)
                 if free[i:i + 2].isprintable() and "\ufffd" not in free[i:i + 2])
    stop = free[start:start + 2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stop=[stop],
                                    extra_body=LONG)
    assert out.choices[0].text == free[:free.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_a_fixed_seed_reproduces_the_output(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body=LONG).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)
    assert sample(-5) == sample(-5) != sample(1234)  # int64 seeds, negatives included


def test_client_dropping_a_stream_aborts_it_and_frees_capacity(server):
    aborted_before = server.num_finished("abort", SLOW_MODEL)
    body = {"model": SLOW_MODEL, "prompt": PROMPT, "max_tokens": 110, "stream": True,
            "ignore_eos": True}
    with httpx.Client(headers=server.headers, timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            first = next(response.iter_lines())
            assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: server.num_unfinished(SLOW_MODEL) == 0)
    assert wait_until(lambda: server.num_finished("abort", SLOW_MODEL) == aborted_before + 1)


def test_client_timing_out_a_plain_request_aborts_it(server):
    # The slow engine needs seconds for these tokens, so the request surely runs when the
    # client leaves after 50 ms: on the tiny model's own speed it could end first.
    aborted_before = server.num_finished("abort", SLOW_MODEL)
    body = {"model": SLOW_MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(10, read=0.05))
    assert wait_until(lambda: server.num_unfinished(SLOW_MODEL) == 0)
    assert wait_until(lambda: server.num_finished("abort", SLOW_MODEL) == aborted_before + 1)
    assert server.num_finished("length", SLOW_MODEL) == 0


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT},
                        headers=server.headers).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]},
                      headers=server.headers).json()
    assert text == {"prompt": PROMPT}


def test_health_and_readiness_are_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["model"] == MODEL


def test_a_traced_request_is_served(server):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          headers={**server.headers, "traceparent": parent},
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


def test_a_request_past_its_deadline_is_504_or_ends_with_abort_when_streamed(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 110, "ignore_eos": True,
            "timeout_s": 0.05}
    response = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                          timeout=60)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True},
                          headers=server.headers, timeout=60)
    lines = [line for line in streamed.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert wait_until(lambda: server.num_unfinished() == 0)
