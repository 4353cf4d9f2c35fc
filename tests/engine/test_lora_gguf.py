"""LoRA adapters on GGUF imports: an adapter on a model that keeps the file's blocks as stored
gives the tokens (and, within the blocks' own rounding, the logits) it gives on the float32
import of the same file; a GGUF LoRA file (llama.cpp's convert_lora_to_gguf output) loads as
the PEFT adapter it was converted from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support import gguf_lora
from support.gguf_files import write_tiny_gguf
from support.lora_engines import PROMPTS, first_logits, make_engine, run
from tokenserve.engine.lora_adapter import LoraRequest, load_adapter

pytest.importorskip("gguf")

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
    # echo + logprobs' full pass over the blocks, with the adapter's deltas
    layers = engines[0].loras.weights_of(lora).layers
    # (its block products round apart from the float import's by up to 0.05 at some
    # positions without an adapter, 0.1 with one: a tenth of what the adapter changes)
    prompt = [engine.runner.prompt_logits(PROMPTS[0], layers) for engine in engines]
    np.testing.assert_allclose(prompt[0], prompt[1], atol=0.2, rtol=0)
    assert np.abs(prompt[0][-1] - logits[1][0]).max() > 1.0


def write_gguf_lora(path, tensors: dict, **options):
    return gguf_lora.write_gguf_lora(path, tensors, HEADS, KV_HEADS, **options)


def test_a_gguf_lora_file_is_the_peft_adapter_it_was_converted_from(gguf_models, tmp_path):
    _, floats, adapter = gguf_models
    config = floats[2].model
    tensors = peft_factors()
    expected = load_adapter(adapter, config, max_rank=8).layers
    for kind, atol in (("F32", 0.0), ("F16", 2e-3)):
        got = load_adapter(write_gguf_lora(tmp_path / f"{kind}.gguf", tensors, kind=kind),
                           config, max_rank=8).layers
        for want, have in zip(expected, got):
            assert want.keys() == have.keys()
            for role in want:
                for x, y in zip(want[role], have[role]):
                    np.testing.assert_allclose(y, x, atol=atol, rtol=0, err_msg=(kind, role))
    # alpha 0: llama.cpp's scale of 1, PEFT's alpha = r
    scaled = load_adapter(write_gguf_lora(tmp_path / "a0.gguf", tensors, alpha=0.0), config,
                          max_rank=8).layers
    np.testing.assert_allclose(scaled[0]["out"][1], expected[0]["out"][1] / 2, rtol=1e-6)
    # served: its rows' logits are the PEFT adapter's, beside it in one step
    engine = make_engine(floats)
    loras = [LoraRequest.new("peft", adapter),
             LoraRequest.new("gguf", tmp_path / "F32.gguf")]
    logits = first_logits(engine, [(PROMPTS[0], lora) for lora in loras])
    np.testing.assert_array_equal(logits[0], logits[1])


def test_bad_gguf_lora_files_are_refused_by_name(gguf_models, tmp_path):
    from tokenserve.engine.lora_adapter import (LoraBaseMismatchError, LoraNotFoundError,
                                                LoraShapeError, LoraTargetError)

    config = gguf_models[1][2].model
    tensors = peft_factors()
    cases = [
        (tmp_path / "missing.gguf", LoraNotFoundError, "does not exist"),
        (write_gguf_lora(tmp_path / "model.gguf", tensors, general_type="model"),
         LoraNotFoundError, "is not a GGUF LoRA adapter"),
        (write_gguf_lora(tmp_path / "qwen2.gguf", tensors, arch="qwen2"),
         LoraBaseMismatchError, "adapter of a GGUF qwen2 model; this model is a Llama"),
        (write_gguf_lora(tmp_path / "norm.gguf", tensors, extra={
            "blk.0.attn_norm.weight.lora_a": np.ones([4, HIDDEN], np.float32)}),
         LoraTargetError, r"'blk\.0\.attn_norm\.weight\.lora_a' targets 'attn_norm'"),
        (write_gguf_lora(tmp_path / "experts.gguf", tensors, extra={
            "blk.1.ffn_up_exps.weight.lora_a": np.ones([4, HIDDEN], np.float32)}),
         LoraTargetError, "part of a mixture of experts"),
        (write_gguf_lora(tmp_path / "shape.gguf", {
            **tensors, "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight":
                np.ones([INTER + 1, 4], np.float32)}),
         LoraShapeError, "mlp.up_proj"),
    ]
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            load_adapter(path, config, max_rank=8)


@pytest.mark.slow  # two MoE engines
def test_an_attention_adapter_on_stored_moe_blocks_matches_the_float_import(tokenizer,
                                                                            tmp_path):
    """Qwen3-MoE's blocks as stored (the experts through the grouped GGUF op) with an
    adapter of q/k/v/o_proj: the float32 import's tokens, and logits within the blocks'
    rounding."""
    from support.moe_checkpoints import hf_model, write_gguf
    from tokenserve.model.gguf import load_gguf

    routers = {f"blk.{i}.ffn_gate_inp.weight": "F32" for i in range(2)}  # as llama.cpp
    path = write_gguf(tmp_path / "tiny.gguf", hf_model("qwen3moe"), tokenizer, qtype="Q8_0",
                      types=routers)
    rng = np.random.default_rng(2)
    tensors = {}
    for layer in range(2):  # heads 24 wide: q 96, k and v 48
        for module, (width_in, width_out) in {"q_proj": (64, 96), "k_proj": (64, 48),
                                              "v_proj": (64, 48), "o_proj": (96, 64)}.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_"
            tensors[name + "A.weight"] = rng.normal(0, 0.3, [4, width_in]).astype(np.float32)
            tensors[name + "B.weight"] = rng.normal(0, 0.3, [width_out, 4]).astype(np.float32)
    lora = LoraRequest.new("a", write_peft(tmp_path / "adapter", tensors))
    jobs = [(prompt, which) for prompt in PROMPTS for which in (None, lora)]
    stored, floats = load_gguf(path, keep_blocks=True), load_gguf(path)
    assert stored[2].model.weight_format == "gguf"
    engines = [make_engine(loaded) for loaded in (stored, floats)]
    assert run(engines[0], jobs) == run(engines[1], jobs)
    logits = [first_logits(engine, [(PROMPTS[0], None), (PROMPTS[0], lora)])
              for engine in engines]
    np.testing.assert_allclose(logits[0], logits[1], atol=0.05, rtol=0)
    assert np.abs(logits[1][1] - logits[1][0]).max() > 1.0
