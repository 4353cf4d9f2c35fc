"""LoRA adapters of a mixture of experts' experts, shared expert and router through `tokenserve
serve` and the official openai client: named at start and loaded live, each serves peft's
tokens, in streams at once; bad expert factors get a 400 and nothing is loaded."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from support.lora_models import moe_lora_checkpoint, reference_greedy
from support.lora_server import lora_server

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow  # a real server process

KEY = "sk-lora-moe-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    from tokenserve.export.exporter import export_model
    from tokenserve.model.hf import load_hf

    root = tmp_path_factory.mktemp("lora-moe-serve")
    made = moe_lora_checkpoint("qwen2moe", tokenizer, root, num_adapters=3)
    model, hf_tokenizer, config = load_hf(made.directory)
    export_model(model, hf_tokenizer, dataclasses.replace(config, name="moe"), root / "moe",
                 jit_compile=False)
    with lora_server(root, "moe", KEY, "--max_loras=2", "--max_lora_rank=4", "--lora_modules",
                     f"experts={made.adapters[1][0]}", timeout_s=240) as url:
        yield {"url": url, "made": made, "tokenizer": hf_tokenizer, "log": root / "server.log"}


def complete(server, model: str, max_tokens: int = 6) -> str:
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text.rstrip("\ufffd")


def expected_text(server, hf_model, max_tokens: int = 6) -> str:
    tokenizer = server["tokenizer"]
    tokens = reference_greedy(hf_model, tokenizer.encode(PROMPT), max_tokens)
    return tokenizer.decode(tokens).rstrip("\ufffd")


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(server["url"] + "/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": name, "lora_path": str(path)})


def test_expert_adapters_serve_peft_tokens_side_by_side(server):
    made = server["made"]
    assert load(server, "around", made.adapters[2][0]).status_code == 200
    jobs = {"moe": made.hf_model, "experts": made.adapters[1][1],
            "around": made.adapters[2][1]}
    with ThreadPoolExecutor(len(jobs)) as pool:  # their streams in the same steps
        texts = dict(zip(jobs, pool.map(lambda name: complete(server, name), jobs)))
    assert texts == {name: expected_text(server, model) for name, model in jobs.items()}
    assert "MiB for the experts'" in server["log"].read_text()  # the slot cost, logged


def test_bad_expert_factors_get_400_and_nothing_is_loaded(server, tmp_path):
    from safetensors.numpy import save_file

    def adapter(name: str, module: str, a_shape, b_shape) -> str:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
        stem = f"base_model.model.model.layers.0.{module}.lora_"
        save_file({stem + "A.weight": np.ones(a_shape, np.float32),
                   stem + "B.weight": np.ones(b_shape, np.float32)},
                  str(directory / "adapter_model.safetensors"))
        return str(directory)

    d, f, e = 64, 32, 8  # support.moe_checkpoints' Qwen2-MoE
    cases = {"rank": (adapter("rank", "mlp.experts", [e * 5, f], [d, e * 5]), "max_lora_rank"),
             "shape": (adapter("shape", "mlp.experts.1.down_proj", [2, f + 1], [d, 2]),
                       "do not fit"),
             "expert": (adapter("expert", f"mlp.experts.{e}.up_proj", [2, d], [f, 2]),
                        f"expert {e}")}
    for case, (path, reason) in cases.items():
        answer = load(server, f"bad-{case}", path)
        assert answer.status_code == 400, (case, answer.text)
        assert reason in answer.json()["error"]["message"], (case, answer.text)
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    assert not {m.id for m in client.models.list().data if m.id.startswith("bad-")}
    assert complete(server, "experts") == expected_text(server, server["made"].adapters[1][1])
