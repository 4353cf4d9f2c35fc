"""`tokenserve serve` with encoders beside a generator, as users run it: /v1/embeddings through
the official openai client (floats and base64), /v1/rerank over plain HTTP, TF Serving's
Predict on the embed signature, every bad input a precise 4xx while the server keeps
serving, a full queue a 429, and embeddings while completions stream."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from support.openai_harness import export_tiny_model
from support.servables import free_port

KEY = "sk-encoder-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["def add(a, b):", "", "ünïcödé 日本語", "for item in items: print(item)"]


@pytest.fixture(scope="module")
def server(tiny_encoders, tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders-served")
    export_tiny_model(root / "tiny")
    models = {"tiny": root / "tiny", "embed": tiny_encoders["embed"],
              "rerank": tiny_encoders["rerank"]}
    config = root / "models.config"
    config.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{path}" model_platform: "tensorflow" }}\n'
        for name, path in models.items()) + "}\n")
    ports = {name: free_port() for name in ("grpc", "rest", "openai")}
    log = open(root / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenserve", "serve", f"--port={ports['grpc']}",
         f"--rest_api_port={ports['rest']}", f"--openai_port={ports['openai']}",
         f"--model_config_file={config}", f"--api_key={KEY}", "--precision=float32",
         "--max_num_seqs=4", "--max_queue_tokens=64", "--noui"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    url = f"http://127.0.0.1:{ports['openai']}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, (root / "server.log").read_text()
        try:
            served = httpx.get(url + "/v1/models", headers=AUTH).text
            if all(f'"{name}"' in served for name in models):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield {"openai": url, "rest": f"http://127.0.0.1:{ports['rest']}"}
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(tiny_encoders):
    """The tiny models in this process, to hold the server's numbers to."""
    from tokenserve.model.encoder_hf import load_hf_encoder

    return {"embed": load_hf_encoder(tiny_encoders["embed-hf"]),
            "rerank": load_hf_encoder(tiny_encoders["rerank-hf"])}


def embed_alone(reference, texts: list[str]) -> np.ndarray:
    encoder, tokenizer, _ = reference["embed"]
    rows = []
    for text in texts:
        ids = np.asarray([tokenizer.encode(text).token_ids], np.int32)
        rows.append(encoder.embed(ids, np.ones_like(ids)).numpy()[0])
    return np.stack(rows)


def client(server):
    import openai

    return openai.OpenAI(base_url=server["openai"] + "/v1", api_key=KEY, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server["openai"] + path, json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_embeddings_equal_the_model(server, reference, encoding_format):
    answer = client(server).embeddings.create(model="embed", input=TEXTS,
                                              encoding_format=encoding_format)
    if encoding_format == "base64":  # the client hands back the string as sent
        vectors = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4")
                            for d in answer.data])
    else:
        vectors = np.asarray([d.embedding for d in answer.data])
    assert [d.index for d in answer.data] == [0, 1, 2, 3] and answer.model == "embed"
    np.testing.assert_allclose(vectors, embed_alone(reference, TEXTS), atol=1e-5)
    num_tokens = sum(len(reference["embed"][1].encode(t).token_ids) for t in TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens


def test_token_id_inputs_and_the_default_encoding(server, reference):
    ids = reference["embed"][1].encode(TEXTS[0]).token_ids
    one = client(server).embeddings.create(model="embed", input=ids)  # base64 by default
    many = post(server, "/v1/embeddings", {"model": "embed", "input": [ids, ids[:3]],
                                           "dimensions": 32}).json()
    expected = embed_alone(reference, [TEXTS[0]])[0]
    np.testing.assert_allclose(one.data[0].embedding, expected, atol=1e-5)
    np.testing.assert_allclose(many["data"][0]["embedding"], expected, atol=1e-5)
    assert len(many["data"]) == 2 and many["usage"]["prompt_tokens"] == len(ids) + 3


def test_rerank_orders_documents_by_the_cross_encoders_scores(server, reference):
    encoder, tokenizer, _ = reference["rerank"]
    query, documents = "what adds numbers", TEXTS + ["import os"]
    answer = post(server, "/v1/rerank", {"model": "rerank", "query": query,
                                         "documents": documents, "top_n": 3})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = []
    for text in documents:
        pair = tokenizer.encode_pair(query, text)
        ids, types = (np.asarray([x], np.int32) for x in (pair.token_ids, pair.type_ids))
        logit = encoder.classify(ids, np.ones_like(ids), types).numpy()[0, 0]
        expected.append(1 / (1 + np.exp(-logit)))
    best = np.argsort(-np.asarray(expected), kind="stable")[:3]
    assert [r["index"] for r in body["results"]] == list(best)
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                               np.asarray(expected)[best], atol=1e-5)
    assert [r["document"]["text"] for r in body["results"]] == [documents[i] for i in best]
    assert body["model"] == "rerank" and body["usage"]["total_tokens"] > 0
    # Cohere's objects, vLLM's other paths, without the documents echoed
    bare = post(server, "/v2/rerank", {"model": "rerank", "query": query, "return_documents":
                                       False, "documents": [{"text": t} for t in documents]})
    assert [r["index"] for r in bare.json()["results"]][:3] == list(best)
    assert all("document" not in r for r in bare.json()["results"])


def test_rerank_with_an_embedding_model_ranks_by_cosine(server, reference):
    body = post(server, "/rerank", {"model": "embed", "query": TEXTS[0],
                                    "documents": TEXTS[1:] + [TEXTS[0]]}).json()
    assert body["results"][0]["index"] == 3  # the query itself
    assert body["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/embeddings", {"model": "embed", "input": []}, 400, "input"),
    ("/v1/embeddings", {"model": "embed", "input": [[]]}, 400, "input"),
    ("/v1/embeddings", {"model": "embed", "input": [1, "a"]}, 400, "input"),
    ("/v1/embeddings", {"model": "embed", "input": {"text": "x"}}, 400, "input"),
    ("/v1/embeddings", {"model": "embed", "input": [5, 100000]}, 400, "input"),
    ("/v1/embeddings", {"model": "embed", "input": "item " * 60}, 400, "input"),
    ("/v1/embeddings", {"model": "embed", "input": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("/v1/embeddings", {"model": "embed", "input": "x", "dimensions": 8}, 400, "dimensions"),
    ("/v1/embeddings", {"model": "embed", "input": "x", "encoding_format": "int8"}, 400,
     "encoding_format"),
    ("/v1/embeddings", {"model": "tiny", "input": "x"}, 400, "model"),
    ("/v1/embeddings", {"model": "rerank", "input": "x"}, 400, "model"),
    ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "model"),
    ("/v1/embeddings", {"model": "embed", "input": ["item " * 20] * 3}, 429, None),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": [3]}, 400, "documents"),
    ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "top_n": -1}, 400,
     "top_n"),
    ("/v1/rerank", {"model": "rerank", "documents": ["d"]}, 400, "query"),
    ("/v1/rerank", {"model": "tiny", "query": "q", "documents": ["d"]}, 400, "model"),
    ("/v1/completions", {"model": "embed", "prompt": "x"}, 400, "model"),
    ("/v1/chat/completions", {"model": "rerank", "messages": [{"role": "user",
                                                               "content": "x"}]}, 400, "model"),
])
def test_each_bad_input_gets_a_precise_status_and_the_server_keeps_serving(
        server, path, body, status, param):
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    if param is not None:
        assert error["param"] == param or param in error["message"], error
    assert post(server, "/v1/embeddings", {"model": "embed", "input": "x"}).status_code == 200


def test_long_inputs_are_cut_when_asked_and_keys_are_required(server):
    answer = post(server, "/v1/embeddings", {"model": "embed", "input": "item " * 60,
                                             "truncate_prompt_tokens": -1})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 48
    assert httpx.post(server["openai"] + "/v1/embeddings",
                      json={"model": "embed", "input": "x"}).status_code == 401
    assert httpx.post(server["openai"] + "/v1/rerank", json={"model": "rerank", "query": "q",
                                                             "documents": ["d"]}
                      ).status_code == 401


def test_tf_serving_predict_runs_the_embed_signature(server, reference):
    ids = reference["embed"][1].encode(TEXTS[0]).token_ids
    answer = httpx.post(server["rest"] + "/v1/models/embed:predict", headers=AUTH, json={
        "signature_name": "embed",
        "inputs": {"input_ids": [ids], "attention_mask": [[1] * len(ids)]}})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["outputs"][0], embed_alone(reference,
                                                                        [TEXTS[0]])[0],
                               atol=1e-5)


def test_metrics_count_encoder_requests(server):
    post(server, "/v1/embeddings", {"model": "embed", "input": ["a", "b"]})
    metrics = httpx.get(server["openai"] + "/metrics", headers=AUTH).text
    assert 'vllm:prompt_tokens_total{model_name="embed"' in metrics
    assert 'reason="queue_full"' in metrics or "queue_full" in metrics


def test_embeddings_while_completions_stream(server):
    """Mixed traffic: embedding requests answered while four completions stream; both kinds
    finish (the latencies are printed, not asserted)."""
    import openai

    streamed, stream_errors = [], []

    def stream_one() -> None:
        try:
            chunks = client(server).completions.create(
                model="tiny", prompt="def add(a, b):", max_tokens=48, stream=True,
                extra_body={"ignore_eos": True})
            streamed.append(sum(1 for _ in chunks))
        except openai.OpenAIError as error:  # reported below, with the counts
            stream_errors.append(error)

    threads = [threading.Thread(target=stream_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    latencies = []
    while any(t.is_alive() for t in threads) or len(latencies) < 5:
        started = time.perf_counter()
        answer = post(server, "/v1/embeddings", {"model": "embed", "input": TEXTS})
        assert answer.status_code == 200
        latencies.append(time.perf_counter() - started)
    for thread in threads:
        thread.join()
    assert not stream_errors and len(streamed) == 4
    print(f"\nembeddings while streaming: {len(latencies)} requests, median "
          f"{np.median(latencies) * 1e3:.0f} ms, max {max(latencies) * 1e3:.0f} ms")
