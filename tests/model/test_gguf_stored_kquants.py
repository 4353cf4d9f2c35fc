"""GGUF imports that keep K-quant tensors as stored (Q4_K, Q5_K, Q6_K super-blocks of 256): a
Q4_K_M-like file (Q4_K, with Q6_K value/down projections and embedding, Q5_K gate) keeps every
tensor's bytes, computes what the dequantized import computes up to the activations' rounding,
and the engine's cached decode equals full forward passes."""

from __future__ import annotations

import numpy as np
import pytest

from support.gguf_files import write_tiny_gguf
from support.tiny_models import greedy_by_full_forward

gguf = pytest.importorskip("gguf")

PROMPTS = ["def add(a, b):", "import os"]
TYPES = {"token_embd.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K",
         "blk.1.ffn_down.weight": "Q6_K", "blk.0.ffn_gate.weight": "Q5_K"}


@pytest.fixture(scope="module")
def kquant_file(tokenizer, tmp_path_factory):
    from tokenserve.model.gguf import load_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("kq") / "tiny.gguf", tokenizer, "Q4_K",
                           types=TYPES, hidden=256, inter=512)
    model, tok, config = load_gguf(path, keep_blocks=True)
    return path, model, load_gguf(path, keep_blocks=False)[0], config, tok


def test_k_quant_tensors_are_kept_as_stored(kquant_file):
    path, model, _, config, _ = kquant_file
    specs = dict(config.model.gguf_block_types)
    assert config.model.weight_format == "gguf"
    assert specs["block_0/qkv"] == "q4_k*256,q4_k*128,q6_k*128"  # q, k rows Q4_K; v rows Q6_K
    assert specs["block_1/qkv"] == "q4_k" and specs["block_1/down"] == "q6_k"
    assert specs["token_embedding"] == "q6_k"
    assert specs["block_0/up"] == "q5_k*512,q4_k*512"  # gate rows, then up rows
    assert "int8" not in specs.values()
    file = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in file.tensors}
    np.testing.assert_array_equal(model.blocks[1].mlp.down.kernel_blocks[0].numpy(),
                                  tensors["blk.1.ffn_down.weight"].data)
    np.testing.assert_array_equal(model.blocks[0].attn.qkv.kernel_blocks[2].numpy(),
                                  tensors["blk.0.attn_v.weight"].data)
    held = sum(w.numpy().nbytes for w in model.weights)
    assert held == sum(int(t.n_bytes) for t in file.tensors)  # the file's bytes, no more


def test_logits_are_close_to_the_dequantized_import(kquant_file, tokenizer):
    _, model, reference, _, _ = kquant_file
    ids = np.asarray([tokenizer.encode(PROMPTS[0])], np.int32)
    got, expected = model(ids).numpy(), reference(ids).numpy()
    # only the activations are quantized (q8_K blocks of 256, a step per 8 values): on these
    # random super-blocks (weights far larger than trained ones) that moves the logits by a
    # visible fraction of the largest; the kernels' own tests check the rounding itself
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert 0 < error < 0.3, error


def test_engine_decode_equals_full_forward(kquant_file):
    from tokenserve.engine.llm import LLM
    from tokenserve.sampling import SamplingParams

    _, model, _, config, tokenizer = kquant_file
    llm = LLM.from_model(model, tokenizer, config, max_num_seqs=4, max_num_batched_tokens=16,
                         block_size=4, kv_cache_dtype="float32")
    assert llm.engine.runner.model.config.weight_format == "gguf"
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == greedy_by_full_forward(model, ids, 8)
