"""The newer families' dense half through the fused ops: QK-norm (Qwen3, Gemma 3), Gemma's
post-norms and GeGLU, a partial rotary (Phi-3's kind). Each tiny family model gives the same
greedy tokens and, within float rounding, the same log-probabilities whether its steps run
the fused ops or the graph (XLA) path, and those tokens are the full forward pass's."""

from __future__ import annotations

import numpy as np
import pytest

from support.compiled_ops import compiled_op_module, use_compiled_op
from support.tiny_models import greedy_by_full_forward
from tokenserve.config import GenerationConfig, TransformerConfig
from tokenserve.kernels import dense as kd
from tokenserve.sampling import SamplingParams

BASE = dict(vocab_size=512, max_seq_len=128, hidden_size=64, num_layers=3, num_heads=4,
            num_kv_heads=2, intermediate_size=96, norm="rmsnorm", norm_eps=1e-6,
            position="rope", mlp="swiglu", qkv_bias=False, out_bias=False, mlp_bias=False,
            tie_embeddings=False)
GEMMA = dict(post_norms=True, mlp="geglu", sliding_windows=(5, 0, 5), attn_scale=24 ** -0.5,
             embedding_multiplier=8.0, tie_embeddings=True)
FAMILIES = {
    "qwen3": dict(head_dim=32, qk_norm=True),  # a head width of its own, QK-norm
    "gemma3": dict(GEMMA, head_dim=32, qk_norm=True, local_rope_theta=100.0),
    # soft-capped scores (in the paged attention op) and logits
    "gemma2": dict(GEMMA, head_dim=16, attn_softcap=5.0, final_softcap=3.0),
    "phi3": dict(rotary_dim=8),  # head_dim 16: half of each head turns
}
# longer than the windows (5), so the windowed layers matter
PROMPTS = [list(range(5, 29)), [12, 44, 1, 77], [300, 301, 302, 303, 304, 8, 9, 10, 11]]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def compiled():
    return compiled_op_module(kd.LIBRARY)


def family_model(name: str, tokenizer):
    """(model, generation config): the family's tiny model, with every norm's scale
    perturbed so that a norm the fused path skipped or misplaced would show."""
    from tokenserve.model import build_model

    config = TransformerConfig(**{**BASE, **FAMILIES[name]})
    model = build_model(config, seed=0)
    rng = np.random.default_rng(1)
    for variable in model.weights:
        if "norm" in variable.path:
            noise = 0.3 * rng.standard_normal(variable.shape)
            variable.assign((variable.numpy() + noise).astype(np.float32))
    generation = GenerationConfig(model=config, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, name=name)
    return model, generation


def run_engine(model, generation, tokenizer, max_fused_dense_tokens: int):
    """Each prompt's greedy tokens and their log-probabilities (top 5 each), all prompts in
    one batch; and the runner."""
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner

    runner = ModelRunner(model, generation, EngineConfig(
        block_size=4, precision="float32", max_num_batched_tokens=64,
        max_fused_dense_tokens=max_fused_dense_tokens))
    engine = LLMEngine(runner, tokenizer, runner.engine_config)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=5)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(engine.make_request(prompt, params, f"r{i}"))
    tokens, logprobs = {}, {}
    while engine.has_work:
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
            logprobs.setdefault(output.request_id, []).extend(output.outputs[0].logprobs)
    return tokens, logprobs, runner


# Gemma 3 (QK-norm, post-norms, GeGLU, windows) and Phi-3 (a partial rotary) by default; Qwen3
# (QK-norm alone) and Gemma 2 (soft caps; the op's cap has its own kernel test) under -m slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in (
    "qwen3", "gemma2") else []) for name in FAMILIES])
def test_fused_steps_equal_the_graph_path(compiled, monkeypatch, tokenizer, name):
    use_compiled_op(monkeypatch, kd.LIBRARY)
    model, generation = family_model(name, tokenizer)
    fused_tokens, fused_logprobs, runner = run_engine(model, generation, tokenizer, 1024)
    graph_tokens, graph_logprobs, graph_runner = run_engine(model, generation, tokenizer, 0)
    assert runner.step.kernel_dense
    assert all(key[2] for key in runner.step._steps)  # every step fused
    assert not any(key[2] for key in graph_runner.step._steps)  # and none here
    assert fused_tokens == graph_tokens
    for i, prompt in enumerate(PROMPTS):
        assert fused_tokens[f"r{i}"] == greedy_by_full_forward(model, prompt, NUM_TOKENS)
        for mine, theirs in zip(fused_logprobs[f"r{i}"], graph_logprobs[f"r{i}"]):
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            np.testing.assert_allclose([v for _, v in mine.top], [v for _, v in theirs.top],
                                       atol=1e-4)
    # one op a layer for the block's second half (post-norms inside it) and one for the
    # split with QK-norm and RoPE: no graph norms, no graph RoPE (no Neg)
    for key, call in runner.step._concrete.items():
        ops = [op.type for op in call.concrete.graph.get_operations()]
        layers = generation.model.num_layers
        assert ops.count("TokenserveFinishBlock") == layers, key
        assert ops.count("TokenserveSplitRope") == layers, key
        # the first block's attention norm, and the final norm where the head is in the step
        head_norms = 1 if runner.step.screened_head is None else 0
        assert ops.count("TokenserveNorm") == 1 + head_norms, key
        assert "Neg" not in ops and "Rsqrt" not in ops, key
