"""GGUF mixtures of experts keep their expert blocks as stored (`keep_blocks`): each expert's
slice of the stacked ffn_{gate,up,down}_exps tensors held as the file's bytes, logits close
to the dequantized import's, and the engine's step running one block op a layer
(TokenserveMoeGgufLayer) whose greedy tokens are full forward passes' and the dequantized
import's but at near-ties. A role without a block kernel (F16) is int8, named in the log."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from support.greedy_checks import assert_greedy_up_to_near_ties
from support.moe_checkpoints import PROMPTS, hf_model, write_gguf
from support.tiny_models import greedy_by_full_forward
from tokenserve.model.gguf import load_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("transformers")

# llama.cpp keeps the router F32; here one layer's down experts are another type
QWEN3_TYPES = {"blk.0.ffn_gate_inp.weight": "F32", "blk.1.ffn_gate_inp.weight": "F32",
               "blk.1.ffn_down_exps.weight": "Q8_0", "blk.0.ffn_up_exps.weight": "Q4_1"}


@pytest.fixture(scope="module")
def qwen3(tokenizer, tmp_path_factory):
    """(file, as-stored model, its generation config, dequantized model, tokenizer)."""
    path = write_gguf(tmp_path_factory.mktemp("qwen3moe") / "tiny.gguf",
                      hf_model("qwen3moe", skewed=True), tokenizer, qtype="Q4_0",
                      types=QWEN3_TYPES)
    model, tok, config = load_gguf(path, keep_blocks=True)
    return path, model, config, load_gguf(path)[0], tok


def test_each_expert_holds_its_slice_of_the_stacked_blocks(qwen3):
    path, model, config, _, _ = qwen3
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    specs = dict(config.model.gguf_block_types)
    assert specs["block_0/expert_5_up"] == "q4_0*32,q4_1*32"  # gate rows, then up rows
    assert specs["block_1/expert_5_down"] == "q8_0"
    assert "int8" not in specs.values()
    moe = model.blocks[1].mlp
    for e in (0, 5):
        up, down = moe.experts[e]
        np.testing.assert_array_equal(up.kernel_blocks[0].numpy(),
                                      tensors["blk.1.ffn_gate_exps.weight"].data[e])
        np.testing.assert_array_equal(up.kernel_blocks[1].numpy(),
                                      tensors["blk.1.ffn_up_exps.weight"].data[e])
        np.testing.assert_array_equal(down.kernel_blocks[0].numpy(),
                                      tensors["blk.1.ffn_down_exps.weight"].data[e])
    np.testing.assert_array_equal(moe.router.kernel.numpy(),
                                  tensors["blk.1.ffn_gate_inp.weight"].data.T)
    # weights resident: the file's tensor bytes, nothing dequantized beside them
    assert sum(w.numpy().nbytes for w in model.weights) == sum(
        int(t.n_bytes) for t in tensors.values())


def test_logits_equal_the_dequantized_import_through_the_same_weights(qwen3):
    from tokenserve.model.layers import portable_graphs

    _, model, _, reference, _ = qwen3
    ids = np.asarray([PROMPTS[0]], np.int32)
    expected = reference(ids).numpy()
    scale = np.abs(expected).max()
    with portable_graphs():  # the blocks dequantized in stock TF ops
        np.testing.assert_allclose(model(ids).numpy(), expected, rtol=0, atol=1e-4 * scale)
    error = np.abs(model(ids).numpy() - expected).max() / scale  # q8 activations
    assert 0 < error < 0.05, error


def test_engine_steps_run_the_experts_block_op_and_greedy_matches(qwen3):
    from tokenserve.engine.llm import LLM
    from tokenserve.kernels.moe import LIBRARY
    from tokenserve.sampling import SamplingParams

    _, model, config, reference, tok = qwen3
    llm = LLM.from_model(model, tok, config, max_num_seqs=2, max_num_batched_tokens=64,
                         block_size=4, kv_cache_dtype="float32")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate([list(p) for p in PROMPTS[:2]], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        # a full forward pass's choice at each step of the engine's sequence, up to near-ties:
        # the two paths' float sums differ by rounding, and an activation that lands on a q8
        # rounding boundary then takes the next step (1/254 of its group's largest value)
        assert_greedy_up_to_near_ties(model, prompt, tokens, 0.01)
        assert tokens[:4] == greedy_by_full_forward(model, prompt, 4)
        # the dequantized import's choice at each step, up to near-ties
        assert_greedy_up_to_near_ties(reference, prompt, tokens, 0.05)
    if LIBRARY.module() is None:
        return  # no compiler here: the stock-TF grouping ran the blocks
    steps = llm.engine.runner.step._concrete.values()
    ops = [op.type for step in steps for op in step.concrete.graph.get_operations()]
    assert ops.count("TokenserveMoeGgufLayer") == 2 * len(steps)
    load = llm.engine.runner.step.expert_load.read()
    assert load[:, 2].min() > 0 and load[:, 4:].sum() == 0  # skewed: 2 always, 4+ never


def test_a_role_without_a_block_kernel_is_int8_and_named(tokenizer, tmp_path, caplog):
    """Qwen2-MoE's shared expert 48 wide: its down projection F16 (48 values a row fit no
    block), read as int8; the rest keeps its blocks and the logits stay close."""
    reference_hf = hf_model("qwen2moe")
    path = write_gguf(tmp_path / "tiny.gguf", reference_hf, tokenizer, qtype="Q8_0",
                      types={f"blk.{i}.ffn_down_shexp.weight": "F16" for i in range(2)})
    with caplog.at_level(logging.INFO, logger="tokenserve.model.gguf_moe_stored"):
        model, _, config = load_gguf(path, keep_blocks=True)
    assert "blk.1.ffn_down_shexp.weight (F16) has no block kernel" in caplog.text
    specs = dict(config.model.gguf_block_types)
    assert specs["block_1/shared_down"] == "int8"
    assert specs["block_1/shared_up"] == "q8_0*48,q8_0*48"
    assert specs["block_1/expert_3_down"] == "q8_0"
    ids = np.asarray([PROMPTS[1]], np.int32)
    expected = load_gguf(path)[0](ids).numpy()
    error = np.abs(model(ids).numpy() - expected).max() / np.abs(expected).max()
    assert error < 0.03, error
