"""LoRA adapters on GGUF imports: an adapter on a model that keeps the file's blocks as stored
gives the tokens (and, within the blocks' own rounding, the logits) it gives on the float32
import of the same file; a GGUF LoRA file (llama.cpp's convert_lora_to_gguf output) loads as
the PEFT adapter it was converted from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.gguf_files import write_tiny_gguf
from tokenserve.engine.lora_adapter import LoraRequest, load_adapter

pytest.importorskip("gguf")

from test_lora import MAX_TOKENS, PROMPTS, first_logits, make_engine, run  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
MODULES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN // 2),
           "self_attn.v_proj": (HIDDEN, HIDDEN // 2), "self_attn.o_proj": (HIDDEN, HIDDEN),
           "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER),
           "mlp.down_proj": (INTER, HIDDEN)}
"""The tiny GGUF llama's modules, (in, out) each (support.gguf_files.write_tiny_gguf's)."""


def peft_factors(rank: int = 4, seed: int = 1) -> dict[str, np.ndarray]:
    """Random PEFT factors of every module of the tiny llama, under PEFT's names."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, (width_in, width_out) in MODULES.items():
            name = f"base_model.model.model.layers.{layer}.{module}.lora_"
            tensors[name + "A.weight"] = rng.normal(0, 0.3, [rank, width_in]).astype(np.float32)
            tensors[name + "B.weight"] = rng.normal(0, 0.3, [width_out, rank]).astype(
                np.float32)
    return tensors


def write_peft(directory, tensors: dict, rank: int = 4, alpha: float = 8.0):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    targets = sorted({module.split(".")[-1] for module in MODULES})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def gguf_models(tokenizer, tmp_path_factory):
    """(as stored, float32 import) of one tiny Q8_0 llama GGUF file, and a PEFT adapter."""
    from tokenserve.model.gguf import load_gguf

    folder = tmp_path_factory.mktemp("gguf-lora")
    path = write_tiny_gguf(folder / "tiny.gguf", tokenizer, "Q8_0")
    adapter = write_peft(folder / "adapter", peft_factors())
    return (load_gguf(path, keep_blocks=True), load_gguf(path, keep_blocks=False), adapter)


def test_an_adapter_on_stored_blocks_matches_the_float_import(gguf_models):
    stored, floats, adapter = gguf_models
    assert stored[2].model.weight_format == "gguf" and floats[2].model.weight_format == "float"
    lora = LoraRequest.new("a", adapter)
    jobs = [(prompt, which) for prompt in PROMPTS for which in (None, lora)]
    engines = [make_engine(loaded) for loaded in (stored, floats)]
    tokens = [run(engine, jobs) for engine in engines]
    assert tokens[0] == tokens[1]
    logits = [first_logits(engine, [(PROMPTS[0], None), (PROMPTS[0], lora)])
              for engine in engines]
    np.testing.assert_allclose(logits[0], logits[1], atol=0.05, rtol=0)
    # the adapter changes the logits far more than the blocks' rounding does
    assert np.abs(logits[1][1] - logits[1][0]).max() > 1.0
