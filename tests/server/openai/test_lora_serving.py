"""LoRA adapters through `tokenserve serve` and the official openai client: adapters named at
start and loaded live serve as model ids with peft's tokens, unloading lets streams in
flight finish, and bad adapters get a 400 with nothing loaded."""

from __future__ import annotations

import threading

import httpx
import pytest

from support.lora_models import lora_checkpoint, make_adapter, reference_greedy
from support.lora_server import lora_server

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow  # a real server process: about 80 s on a 2-core VM

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    from tokenserve.export.exporter import export_model
    from tokenserve.model.hf import load_hf

    root = tmp_path_factory.mktemp("lora-serve")
    made = lora_checkpoint("llama", tokenizer, root, num_adapters=2)
    model, hf_tokenizer, config = load_hf(made.directory)
    config = __import__("dataclasses").replace(config, name="tiny")
    export_model(model, hf_tokenizer, config, root / "tiny", jit_compile=False)
    with lora_server(root, "tiny", KEY, "--max_loras=1", "--max_lora_rank=4",
                     "--lora_modules", f"a0={made.adapters[0][0]}") as url:
        yield {"url": url, "made": made, "root": root, "tokenizer": hf_tokenizer}


def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


def expected_text(server, hf_model, max_tokens: int) -> str:
    tokenizer = server["tokenizer"]
    prompt_ids = tokenizer.encode(PROMPT)
    # a last token that ends inside a UTF-8 character is held back by the server's stream
    return tokenizer.decode(reference_greedy(hf_model, prompt_ids, max_tokens)).rstrip("\ufffd")


def complete(server, model: str, max_tokens: int = 6) -> str:
    return client(server).completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text.rstrip("\ufffd")


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(server["url"] + "/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": name, "lora_path": str(path)})


def unload(server, name: str) -> httpx.Response:
    return httpx.post(server["url"] + "/v1/unload_lora_adapter", headers=AUTH,
                      json={"lora_name": name})


def test_adapters_are_model_ids_with_peft_tokens(server):
    made = server["made"]
    models = {m.id: m for m in client(server).models.list().data}
    assert models["a0"].model_extra["parent"] == "tiny"
    assert complete(server, "a0") == expected_text(server, made.adapters[0][1], 6)
    assert complete(server, "tiny") == expected_text(server, made.hf_model, 6)
    assert load(server, "a1", made.adapters[1][0]).status_code == 200
    # one slot for two adapters: they take turns, each with its own tokens
    assert complete(server, "a1") == expected_text(server, made.adapters[1][1], 6)
    assert complete(server, "a0") == expected_text(server, made.adapters[0][1], 6)
    assert unload(server, "a1").status_code == 200
    with pytest.raises(openai.NotFoundError) as refused:
        complete(server, "a1")
    assert refused.value.body["code"] == "model_not_found" or "a1" in str(refused.value)
    metrics = httpx.get(server["url"] + "/metrics", headers=AUTH).text
    assert 'tokenserve:lora_requests_total{adapter="a0",model="tiny"}' in metrics


def test_unloading_lets_streams_finish_across_load_cycles(server):
    """20 load/unload cycles while streams on the adapters run: no failed request, and a
    stream whose adapter is unloaded under it ends with every token it asked for."""
    made = server["made"]
    failures, finished = [], []

    def stream(model: str, started: threading.Event) -> None:
        try:
            chunks = client(server).completions.create(
                model=model, prompt=PROMPT, max_tokens=48, stream=True, temperature=0,
                extra_body={"ignore_eos": True})
            last = next(iter(chunks))
            started.set()
            for last in chunks:
                pass
            finished.append((model, last.choices[0].finish_reason))
        except Exception as error:  # noqa: BLE001 - counted, then asserted on
            failures.append(error)
        finally:
            started.set()

    threads = []
    for cycle in range(20):
        name = f"cycle{cycle}"
        assert load(server, name, made.adapters[cycle % 2][0]).status_code == 200
        started = threading.Event()
        thread = threading.Thread(target=stream, args=(name, started))
        thread.start()
        threads.append(thread)
        assert started.wait(timeout=60)  # its first token is out: it runs on the adapter
        assert unload(server, name).status_code == 200
    for thread in threads:
        thread.join(timeout=120)
    assert not failures
    assert sorted(finished) == sorted((f"cycle{i}", "length") for i in range(20))


def test_bad_adapters_get_400_and_nothing_is_loaded(server, tmp_path):
    from safetensors.numpy import load_file, save_file

    made = server["made"]
    good = made.adapters[0][0]

    def variant(name: str, change) -> str:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "adapter_config.json").write_text(
            (good / "adapter_config.json").read_text())
        tensors = load_file(str(good / "adapter_model.safetensors"))
        save_file(change(tensors), str(directory / "adapter_model.safetensors"))
        return str(directory)

    renamed = variant("unknown-target", lambda t: {
        k.replace("mlp.down_proj", "mlp.fc_out"): v for k, v in t.items()})
    shape = variant("shape", lambda t: {
        k: (v[:-1] if "v_proj.lora_B" in k else v) for k, v in t.items()})
    rank16 = tmp_path / "rank16"
    make_adapter(made.directory, rank16, ["q_proj"], seed=9, rank=16)
    gpt2 = lora_checkpoint("gpt2", server["tokenizer"], tmp_path / "gpt2", num_adapters=1)
    cases = {"missing": (tmp_path / "nowhere", "does not exist"),
             "rank": (rank16, "max_lora_rank"), "target": (renamed, "fc_out"),
             "shape": (shape, "do not fit"), "taken": (good, "already loaded"),
             "other-base": (gpt2.adapters[0][0], "GPT-2")}
    for case, (path, reason) in cases.items():
        name = "a0" if case == "taken" else f"bad-{case}"
        answer = load(server, name, path)
        assert answer.status_code == 400, (case, answer.text)
        assert reason in answer.json()["error"]["message"], (case, answer.text)
    ids = {m.id for m in client(server).models.list().data}
    assert not {i for i in ids if i.startswith("bad-")}
    assert load(server, "tiny", good).status_code == 400  # the base model's name
    assert unload(server, "never-loaded").status_code == 404
    assert httpx.post(server["url"] + "/v1/load_lora_adapter",
                      json={"lora_name": "x", "lora_path": str(good)}).status_code == 401


def test_echo_with_logprobs_on_an_adapter_gives_peft_prompt_logprobs(server):
    """echo + logprobs on an adapter: the prompt's logprobs are the adapted model's (peft's
    log-softmax), not the base's."""
    import numpy as np
    import torch

    made, tokenizer = server["made"], server["tokenizer"]
    answer = client(server).completions.create(model="a0", prompt=PROMPT, max_tokens=1,
                                               echo=True, logprobs=1, temperature=0)
    logprobs = answer.choices[0].logprobs.token_logprobs
    prompt_ids = tokenizer.encode(PROMPT)
    assert logprobs[0] is None and len(logprobs) == len(prompt_ids) + 1
    with torch.no_grad():
        for model, name in ((made.adapters[0][1], "a0"), (made.hf_model, "base")):
            logits = model(torch.tensor([prompt_ids])).logits[0]
            expected = torch.log_softmax(logits, -1)[range(len(prompt_ids) - 1),
                                                     prompt_ids[1:]].numpy()
            if name == "a0":
                np.testing.assert_allclose(logprobs[1:len(prompt_ids)], expected, atol=1e-4)
            else:  # the adapter changes them: the check above could not pass on the base's
                assert not np.allclose(logprobs[1:len(prompt_ids)], expected, atol=1e-4)


def test_a_gguf_lora_file_loads_live_with_peft_tokens(server, tmp_path):
    """llama.cpp's form of an adapter (convert_lora_to_gguf.py's file) as lora_path: the
    tokens of the PEFT adapter it holds; a GGUF file that is no adapter gets a 400."""
    from support.gguf_lora import peft_dir_to_gguf, write_gguf_lora

    made = server["made"]
    path = peft_dir_to_gguf(made.adapters[1][0], tmp_path / "a1.gguf", heads=4, kv_heads=2)
    assert load(server, "g1", path).status_code == 200
    assert complete(server, "g1") == expected_text(server, made.adapters[1][1], 6)
    assert unload(server, "g1").status_code == 200
    model = write_gguf_lora(tmp_path / "model.gguf", {}, 4, 2, general_type="model")
    answer = load(server, "bad-gguf", model)
    assert answer.status_code == 400
    assert "not a GGUF LoRA adapter" in answer.json()["error"]["message"]
