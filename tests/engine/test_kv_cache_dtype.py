"""A 16-bit KV cache under a float32 step: the paged-attention op and its fallback widen the
rows exactly, the engine's greedy output and logits stay those of a float32 cache, perplexity
moves by far less than 0.1 %, and KV blocks still travel to and from the remote tier."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.tiny_models import tiny
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.llm import LLM
from tokenserve.engine.runner import ModelRunner
from tokenserve.kernels import paged_attention as pa
from tokenserve.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "import os", "class Point:\n    def", "for item in items:\n",
           "x", "PATH = os.path.join('a', 'b')"]
HALF_DTYPES = [tf.float16, tf.bfloat16]


def make_cache(h, hkv, dh, dtype, s=5, length=40, num_rows=200, seed=1):
    """float32 q [S, H, Dh]; cache values rounded to `dtype` (as float32 arrays, what the op
    must read) and the 16-bit variables holding them; rows [S, L]; lengths [S]."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((s, h, dh)).astype(np.float32)
    rounded = [tf.cast(tf.cast(rng.standard_normal((num_rows, hkv * dh)) * 3, dtype),
                       tf.float32).numpy() for _ in range(2)]
    variables = [tf.Variable(tf.cast(a, dtype), trainable=False) for a in rounded]
    rows = np.stack([rng.permutation(num_rows)[:length] for _ in range(s)]).astype(np.int32)
    lengths = np.array([1, length, 0, 17, 33][:s], np.int32)
    return q, rounded, variables, rows, lengths


def float32_attention(q, rounded, rows, lengths, scale):
    """The same attention over float32 variables holding the rounded values."""
    keys, values = (tf.Variable(a, trainable=False) for a in rounded)
    return pa.paged_decode_attention_fallback(q, keys, values, rows, lengths, scale).numpy()


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("h,hkv,dh", [(4, 4, 64), (8, 2, 32), (6, 3, 24), (4, 2, 12)])
@pytest.mark.parametrize("path", ["avx2", "scalar", "fallback"])
def test_16bit_cache_reads_as_its_float32_values(dtype, h, hkv, dh, path):
    q, rounded, (kv, vv), rows, lengths = make_cache(h, hkv, dh, dtype)
    scale = 1 / np.sqrt(dh)
    if path == "fallback":
        out = pa.paged_decode_attention_fallback(q, kv, vv, rows, lengths, scale)
    else:
        if not pa.is_compiled():
            pytest.skip("compiled paged attention op unavailable")
        out = pa.compiled_paged_decode_attention(q, kv, vv, rows, lengths, scale,
                                                 isa="auto" if path == "avx2" else "scalar")
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), float32_attention(q, rounded, rows, lengths, scale),
                               rtol=2e-5, atol=2e-5)


def test_handles_need_the_cache_dtype():
    q, rounded, (kv, vv), rows, lengths = make_cache(4, 2, 32, tf.float16)
    expected = float32_attention(q, rounded, rows, lengths, 0.2)
    out = pa.paged_decode_attention(q, kv.handle, vv.handle, rows, lengths, 0.2,
                                    cache_dtype=tf.float16)
    np.testing.assert_allclose(out.numpy(), expected, rtol=2e-5, atol=2e-5)


def test_a_bfloat16_step_refuses_a_float16_cache():
    _, _, (kv, vv), rows, lengths = make_cache(4, 2, 32, tf.float16)
    q = tf.ones([5, 4, 32], tf.bfloat16)
    with pytest.raises(TypeError, match="float16"):
        pa.paged_decode_attention(q, kv, vv, rows, lengths, 0.2)
    with pytest.raises(TypeError, match="float16"):
        pa.paged_decode_attention_fallback(q, kv, vv, rows, lengths, 0.2)


# --------------------------------------------------------------------------------------------
# The engine over a 16-bit cache


def make_llm(model, config, tokenizer, **options) -> LLM:
    """An LLM over an in-memory model (no export), logging every step's logits."""
    engine_config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=24, block_size=4,
                                 precision="float32", **options)
    runner = ModelRunner(model, config, engine_config)
    runner.logits = []
    execute = runner.execute

    def logged(out):
        logits = execute(out)
        runner.logits.append(logits)
        return logits
    runner.execute = logged
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm._num_requests = (
        LLMEngine(runner, tokenizer, engine_config), tokenizer, 0)
    return llm


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def tiny_model(request, tokenizer):
    return tiny(request.param, tokenizer)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("attention", ["op", "fallback"])
def test_greedy_output_and_logits_match_a_float32_cache(tiny_model, tokenizer, kv_cache_dtype,
                                                        attention, monkeypatch):
    if attention == "fallback":
        monkeypatch.setenv(pa.MODE_ENV, "fallback")
    model, config = tiny_model
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = make_llm(model, config, tokenizer, kv_cache_dtype="float32")
    half = make_llm(model, config, tokenizer, kv_cache_dtype=kv_cache_dtype)
    assert half.engine.runner.step.caches[0][0].dtype.name == kv_cache_dtype
    assert half.engine.runner.step.fused_attention == (attention == "op"
                                                       and pa.is_compiled())
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params,
                                                                   use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in half.generate(PROMPTS, params, use_tqdm=False)]
    agree = np.mean([a == b for e, g in zip(expected, got) for a, b in zip(e, g)])
    assert agree >= (1.0 if kv_cache_dtype == "float16" else 0.95)
    # logits of the steps both runs took alike (same batch: same tokens so far)
    steps = [(a, b) for a, b in zip(reference.engine.runner.logits, half.engine.runner.logits)
             if a.shape == b.shape]
    assert steps
    scale = max(float(np.abs(a).max()) for a, _ in steps)
    worst = max(float(np.abs(a - b).max()) for a, b in steps[:8])
    assert worst <= (2e-3 if kv_cache_dtype == "float16" else 2e-2) * scale


def test_builtin_perplexity_moves_less_than_a_tenth_of_a_percent():
    """`tokenserve eval builtin --reference builtin --kv-cache-dtype D`, on 8k tokens."""
    from tokenserve.tools import evaluate

    model, tokenizer, config, _ = evaluate.load_for_eval("builtin", "float32")
    windows = evaluate.heldout_windows(tokenizer, config.max_seq_len, 8192)
    for dtype in ("float16", "bfloat16"):
        result = evaluate.perplexity(evaluate.KVCacheScorer(model, dtype), windows,
                                     batch_size=8, reference=model)
        assert result.delta_percent <= 0.1, (dtype, result)
        assert result.greedy_agreement >= 0.99, (dtype, result)


def test_kv_blocks_round_trip_through_a_float16_cache(tokenizer):
    model, config = tiny("tiny-gpt2", tokenizer)
    runner = ModelRunner(model, config, EngineConfig(block_size=4, precision="float32",
                                                     max_cache_tokens=64,
                                                     kv_cache_dtype="float16"))
    assert runner.kv_dtype == np.float16
    rows = np.random.default_rng(0).standard_normal((2, *runner.kv_block_shape))
    rows = rows.astype(np.float16)
    runner.write_kv_blocks([3, 5], rows)
    np.testing.assert_array_equal(runner.read_kv_blocks([3, 5]), rows)
    np.testing.assert_array_equal(runner.read_kv_blocks([5]), rows[1:])
