"""The engine's bfloat16 step on tiny real models: fused steps compute in float32 from the
bfloat16 weights, greedy steps screen the head, and which steps fuse depends on the CPU's
bf16 matmuls."""

from __future__ import annotations

import numpy as np
import pytest

from support.engines import PROMPTS, engine_config
from support.tiny_models import tiny
from tokenserve.engine.llm import LLM
from tokenserve.sampling import SamplingParams


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def bf16_exact(request, tokenizer, tmp_path_factory):
    """A tiny transformer whose float32 weights are all bfloat16 values, exported."""
    import tensorflow as tf

    from tokenserve.export.exporter import export_model

    model, config = tiny(request.param, tokenizer, seed=3)
    for variable in model.weights:
        variable.assign(tf.cast(tf.cast(variable, tf.bfloat16), variable.dtype))
    return export_model(model, tokenizer, config, tmp_path_factory.mktemp(request.param),
                        jit_compile=False)


@pytest.fixture
def bf16_matmuls(monkeypatch):
    """The engine as it runs on a CPU whose oneDNN has bf16 matmuls (AVX512-BF16 or AMX):
    small steps fused, larger ones through the bfloat16 graph. On a CPU without them the
    engine fuses every step instead (tested below), so here it is told the CPU has them:
    TF's own bf16 matmuls still run there, only slower (Eigen's, as oneDNN's ops are off by
    default on such a CPU)."""
    from tokenserve.engine.step import transformer as tf_step

    monkeypatch.setattr(tf_step, "cpu_has_bf16", lambda: True)


def test_bfloat16_fused_steps_compute_float32_with_the_bfloat16_weights(bf16_exact):
    """bfloat16 weights through the fused ops are widened exactly and multiplied in float32:
    on weights that bfloat16 holds exactly, a bfloat16 engine whose steps are all fused gives
    the float32 engine's tokens and log-probabilities to float rounding (both on a bfloat16
    KV cache), in mixed batches. The bfloat16 graph path, whose activations are bfloat16,
    is 3-4e-3 off here in the log-probabilities: so is an op that misreads the 16-bit words
    or a fused step that rounds its activations."""
    import tensorflow as tf

    def run(**options):
        llm = LLM(bf16_exact, engine_config(max_fused_dense_tokens=1024, kv_cache_dtype="bfloat16",
                                            **options))
        params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return (llm.engine.runner, [o.outputs[0].token_ids for o in outs],
                np.array([lp.logprob for o in outs for lp in o.outputs[0].logprobs]))

    _, want, want_logprobs = run(precision="float32")
    runner, got, logprobs = run(precision="bfloat16")
    assert runner.model.compute_dtype == "bfloat16" and runner.step.kernel_dense
    assert got == want
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=0, atol=1e-4)
    graphs = [c.concrete.graph for key, c in runner.step._concrete.items() if key[2]]
    assert graphs  # fused steps ran, on the bfloat16 matrices as stored
    blocks = [op for op in graphs[0].get_operations() if op.type == "TokenserveFinishBlock"]
    assert blocks and all(op.get_attr("T") == tf.bfloat16 for op in blocks)


def test_bfloat16_greedy_steps_screen_the_head_and_keep_their_tokens(bf16_exact, bf16_matmuls):
    """A bfloat16 engine's greedy steps through the fused ops read the head's int8 screen
    (engine/step/head.py), which recomputes the candidates from the widened bfloat16
    rows: on weights bfloat16 holds exactly, the float32 engine's greedy tokens. Steps
    through the bfloat16 graph (a long prefill) keep that graph's own head, as do steps
    with a row that needs its distribution."""
    def run(precision, max_screened_head_rows, prompts=PROMPTS, **params):
        llm = LLM(bf16_exact, engine_config(
            precision=precision, kv_cache_dtype="bfloat16", max_fused_dense_tokens=None,
            max_screened_head_rows=max_screened_head_rows))
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, **params),
                            use_tqdm=False)
        return llm.engine.runner, [o.outputs[0].token_ids for o in outs]

    runner, got = run("bfloat16", 8)
    _, want = run("float32", 0)
    _, plain = run("bfloat16", 0)
    assert runner.step.screened_head is not None
    assert runner.step.screened_head.weight.dtype.name == "bfloat16"
    vocab, width = runner.vocab_size, runner.config.model.hidden_size
    assert runner.memory_bytes()["head_screen"] == vocab * width + vocab * 8
    assert runner.num_screened_steps > 0
    assert got == want == plain
    # a prompt longer than the fused ops take: its prefill runs the graph and its head
    long_prompt = [PROMPTS[5] * 2]
    runner, got = run("bfloat16", 8, long_prompt)
    assert {key[2] for key in runner.step._steps} == {True, False}
    assert got == run("float32", 0, long_prompt)[1]
    # a float16 copy would be the bfloat16 head's size: no screen
    llm = LLM(bf16_exact, engine_config(precision="bfloat16", head_screen="float16"))
    assert llm.engine.runner.step.screened_head is None


def test_bfloat16_engine_fuses_small_steps_only(tiny_gpt2_dir, bf16_matmuls):
    """On auto, a bfloat16 engine runs steps of up to 8 tokens through the fused ops and
    larger ones through its bfloat16 graph (oneDNN's matmuls), with that graph's own head:
    a long prompt's prefill, then its decodes, take both kinds in one request."""
    from tokenserve.model.precision import BF16_FUSED_TOKENS

    llm = LLM(tiny_gpt2_dir, engine_config(precision="bfloat16", max_fused_dense_tokens=None))
    runner = llm.engine.runner
    assert runner.max_fused_dense_tokens == BF16_FUSED_TOKENS
    assert not runner.step.fused_head and not runner.step.jit_dense
    prompt = PROMPTS[5] * 2  # well over 8 tokens
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
    assert {key[2] for key in runner.step._steps} == {True, False}


def test_bfloat16_without_bf16_hardware_runs_every_step_fused(tiny_gpt2_dir, monkeypatch):
    """Where oneDNN has no bf16 matmul (no AVX512-BF16 or AMX, or capped below them), the
    graph's bf16 matmuls would be emulated, or refused with a process abort under an ISA
    cap: an explicit --precision bfloat16 then runs every step through the fused ops, a
    long prompt's prefill included, as int8 does."""
    from tokenserve.engine.step import transformer as tf_step

    monkeypatch.setattr(tf_step, "cpu_has_bf16", lambda: False)
    llm = LLM(tiny_gpt2_dir, engine_config(precision="bfloat16", max_fused_dense_tokens=None))
    runner = llm.engine.runner
    assert runner.step.fused_every_step and runner.max_fused_dense_tokens == 0
    out = llm.generate([PROMPTS[5] * 2], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
    assert {key[2] for key in runner.step._steps} == {True}
    monkeypatch.setattr(tf_step, "cpu_has_bf16", lambda: True)
    assert not LLM(tiny_gpt2_dir, engine_config(precision="bfloat16")).engine.runner.step \
        .fused_every_step
