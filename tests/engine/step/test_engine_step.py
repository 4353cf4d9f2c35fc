"""The engine's step on tiny real models: the paths a step can take (fused ops, XLA, graph
attention, decode groups) give the same tokens, and its graphs and XLA programs are
traced and compiled once. The bfloat16 step is tested in test_engine_step_bf16.py, the
engine's control flow in test_engine.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np
import pytest

from support.engines import PROMPTS, engine_config
from support.tiny_models import reference_greedy
from tokenserve.engine.step import packing as runner_module
from tokenserve.engine.llm import LLM
from tokenserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def served(exported):
    """(in-memory model, LLM) for each family."""
    model, _, version_dir = exported
    return model, LLM(version_dir, engine_config())


def test_decode_groups_split_by_context_length_cover_every_row_once():
    rng = np.random.default_rng(0)
    decode = [(i, range(int(n)), 0, 1) for i, n in enumerate(rng.integers(1, 700, 40))]
    padded = lambda group: len(group) * -(-max(len(g[1]) for g in group) // 32) * 32  # noqa: E731
    for max_groups, cost in [(1, 0), (2, 0), (4, 0), (6, 128), (6, 10**6)]:
        groups = runner_module.split_by_context(decode, max_groups, cost)
        assert 1 <= len(groups) <= max_groups
        assert sorted(i for g in groups for i, *_ in g) == list(range(40))
        for shorter, longer in zip(groups, groups[1:]):  # ranges of the sorted contexts
            assert max(len(g[1]) for g in shorter) <= min(len(g[1]) for g in longer)
        rows_read = sum(padded(g) for g in groups)
        assert rows_read + cost * len(groups) <= padded(decode) + cost
    assert len(runner_module.split_by_context(decode, 6, 10**6)) == 1
    assert len(runner_module.split_by_context(decode, 6, 0)) == 6
    # six sequences, three padded lengths, free groups: one group per length
    three = [(i, range(n), 0, 1) for i, n in enumerate([5, 70, 9, 100, 66, 30])]
    assert [[i for i, *_ in g] for g in runner_module.split_by_context(three, 6, 0)] == [
        [0, 2, 5], [4, 1], [3]]


@pytest.mark.slow_cases(exported=["tiny-lstm"])
def test_greedy_output_is_exact_when_decode_runs_in_several_context_groups(served, monkeypatch):
    model, llm = served
    runner = llm.engine.runner  # split at every length change
    monkeypatch.setattr(runner, "engine_config",
                        dataclasses.replace(runner.engine_config, decode_group_cost_rows=0))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 40, 70, 100, 35, 8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == reference_greedy(model, prompt, 10, eos=-1)


def test_graph_attention_gives_the_fused_ops_greedy_tokens(exported, served, monkeypatch):
    """Where the paged-attention op cannot be built, the graph path must agree with it."""
    model, llm = served
    if not llm.engine.runner.is_transformer:
        pytest.skip("the LSTM has no attention")
    assert llm.engine.runner.step.fused_attention  # the suite builds the op
    monkeypatch.setenv("TOKENSERVE_PAGED_ATTENTION_KERNEL", "fallback")
    graph = LLM(exported[2], engine_config())
    assert not graph.engine.runner.step.fused_attention
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    fused = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, other in zip(fused, graph.generate(PROMPTS, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == other.outputs[0].token_ids


def test_fused_dense_ops_give_the_xla_paths_greedy_tokens(exported, served):
    """Steps of a few tokens run the dense half as fused ops, larger ones through XLA: both
    must give the same tokens, alone and in mixed batches (prefill chunks beside decodes)."""
    _, llm = served
    runner = llm.engine.runner
    if not runner.is_transformer:
        pytest.skip("the LSTM has no dense blocks to fuse")
    assert runner.step.kernel_dense  # the suite builds the op; float32 weights
    xla_only = LLM(exported[2], engine_config(max_fused_dense_tokens=0))
    all_fused = LLM(exported[2], engine_config(max_fused_dense_tokens=1024))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in xla_only.generate(PROMPTS, params, use_tqdm=False)]
    for engine in (llm, all_fused):
        got = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
    used = {key[2] for key in runner.step._steps} | {key[2] for key in all_fused.engine.runner.step._steps}
    assert used == {True, False}  # both paths really ran
    # a block's second half is one op (its float32 kernels: test_dense_kernel.py)
    graph = next(c.concrete.graph for key, c in all_fused.engine.runner.step._concrete.items()
                 if key[2])
    types = [op.type for op in graph.get_operations()]
    assert types.count("TokenserveFinishBlock") == runner.model.config.num_layers
    # and each block but the last carries the next one's norm and QKV: the first block's
    # attention norm is the only norm left (the final norm is the head's, a function of
    # its own)
    assert types.count("TokenserveNorm") == 1
    head = all_fused.engine.runner.step.head_function(True).concrete.graph
    assert [op.type for op in head.get_operations()].count("TokenserveNorm") == 1
    assert not any(key[2] for key in xla_only.engine.runner.step._steps)


def test_with_few_sequences_xla_steps_run_the_fused_head_and_compile_no_head(exported):
    """With no more sequences than the fused ops take, steps through XLA (prefill chunks
    above the fused share) run the LM head as the fused op: the same greedy tokens as the
    XLA head, and no head program to compile, per row bucket or per token bucket."""
    xla_only = LLM(exported[2], engine_config(max_fused_dense_tokens=0))
    if not xla_only.engine.runner.is_transformer:
        pytest.skip("the LSTM has no dense blocks to fuse")
    llm = LLM(exported[2], engine_config(max_num_seqs=4, max_fused_dense_tokens=4))
    runner = llm.engine.runner
    assert runner.step.fused_head and not xla_only.engine.runner.step.fused_head
    assert runner.xla_programs() == [(8, 0), (16, 0), (32, 0)]
    assert runner.compile_buckets() == 3
    assert runner.step._head.experimental_get_tracing_count() == 0  # never traced
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS[:4]]  # prefills above 4 tokens: XLA steps
    want = [o.outputs[0].token_ids for o in xla_only.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(not key[2] for key in runner.step._steps)  # XLA steps really ran
    assert runner.step._head.experimental_get_tracing_count() == 0


def test_auto_fused_dense_share_is_this_cpus_choice_and_logged(exported, caplog):
    """Left on auto, the runner takes the CPU's choice (tests/model/test_cpu_choices.py), says so,
    and compiles XLA programs only for steps larger than the fused ops take."""
    from tokenserve.model.precision import choose_fused_dense_tokens

    with caplog.at_level(logging.INFO, logger="tokenserve.engine.runner"):
        llm = LLM(exported[2], engine_config(max_fused_dense_tokens=None))
    runner = llm.engine.runner
    if not runner.is_transformer:
        pytest.skip("the LSTM has no dense blocks to fuse")
    chosen, why = choose_fused_dense_tokens(None)
    assert runner.max_fused_dense_tokens == chosen
    assert f"fused ops for steps of up to {chosen} tokens, XLA above ({why})" in caplog.text
    assert all(tokens > chosen for tokens, _ in runner.xla_programs())


def test_the_step_does_not_retrace_for_new_shapes(served):
    _, llm = served
    step = llm.engine.runner.step
    if not llm.engine.runner.is_transformer:
        steps = {"lstm": step.step}
    else:
        steps = step._steps  # one traced graph per (decode groups, prefill?, fused dense?)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    traced = {key: fn.experimental_get_tracing_count() for key, fn in steps.items()}
    if llm.engine.runner.is_transformer:  # decode-only and prefill-only steps both ran
        assert {key[:2] for key in traced} >= {(1, False), (0, True)}
    llm.generate(PROMPTS, SamplingParams(max_tokens=7), use_tqdm=False)
    llm.generate(["def " * 20], SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(fn.experimental_get_tracing_count() == 1 for fn in steps.values())
    assert set(traced) <= set(steps)


def test_xla_dense_layers_compile_once_per_token_bucket(served):
    _, llm = served
    if not llm.engine.runner.is_transformer:
        pytest.skip("the LSTM step has no dense XLA blocks")
    step = llm.engine.runner.step
    assert step.jit_dense  # float32 runs its dense layers through XLA
    # logprobs: rows that need their whole distribution, which a screened head does not
    # give, so the prompts' XLA steps run the XLA head too
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, logprobs=0), use_tqdm=False)
    # every layer shares one XLA function: one trace, whatever the layer or bucket
    dense = (step._enter, step._between, step._exit, step._head)
    traces = [fn.experimental_get_tracing_count() for fn in dense]
    llm.generate(PROMPTS, SamplingParams(max_tokens=9), use_tqdm=False)
    assert [fn.experimental_get_tracing_count() for fn in dense] == traces == [1, 1, 1, 1]
    # and the XLA programs a step can run compile ahead of the first request: each token
    # bucket above the fused ops' 4 tokens, up to 32 >= 24 tokens, with its LM head on up to
    # 8 rows (max_num_seqs), then the head's other row buckets
    runner = llm.engine.runner
    assert runner.xla_programs() == [(8, 8), (16, 8), (32, 8), (8, 1), (8, 2), (8, 4)]
    assert runner.compile_buckets() == 6
    # compiling runs them from a one-layer graph that reuses the step's traces
    assert [fn.experimental_get_tracing_count() for fn in dense] == [1, 1, 1, 1]


COMPILE_THEN_SERVE = """
import json, os, sys
cache, model_dir = sys.argv[1], sys.argv[2]
os.environ["TF_XLA_FLAGS"] = f"--tf_xla_persistent_cache_directory={cache}"
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.llm import LLM
from tokenserve.sampling import SamplingParams

llm = LLM(model_dir, EngineConfig(max_num_seqs=8, max_num_batched_tokens=24, block_size=4,
                                  precision="float32", max_fused_dense_tokens=4))
shapes = llm.engine.runner.compile_buckets()
compiled = set(os.listdir(cache))
prompts = [[5 + i] * n for i, n in enumerate([3, 9, 17, 24, 1, 6, 12, 2])]
llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
print(json.dumps({"shapes": shapes, "compiled": len(compiled),
                  "new": sorted(set(os.listdir(cache)) - compiled)}))
"""


def test_compiled_buckets_leave_nothing_for_live_steps_to_compile(tiny_gpt2_dir, tmp_path):
    """compile_buckets compiles the very programs the steps then run: with XLA's persistent
    cache on, steps of every bucket (prefill chunks of 5-24 tokens, 1-8 sequences) add no
    program to it. A program compiled some other way (an eager call of the dense functions
    was measured to be one) would not be found by the step, and would be compiled again
    under a request."""
    import json
    import subprocess
    import sys

    cache = tmp_path / "xla"
    cache.mkdir()
    done = subprocess.run([sys.executable, "-c", COMPILE_THEN_SERVE, str(cache),
                           str(tiny_gpt2_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["shapes"] == 6 and report["compiled"] >= 6
    assert report["new"] == []


def test_the_warmup_traces_what_a_first_long_prompt_and_a_second_arrival_need(exported):
    """A prompt longer than the fused dense ops take, alone and then while another decodes,
    and a short prompt alone and then while another decodes, run step graphs the warmup
    traced already (a trace in a user's request costs its TTFT), and the warmup leaves no
    block in the prefix cache."""
    from tokenserve.engine.async_engine import AsyncEngine

    _, _, version_dir = exported
    engine = AsyncEngine.from_model_dir(version_dir, engine_config(enable_prefix_caching=True))
    try:
        runner = engine.engine.runner
        if not runner.is_transformer:
            pytest.skip("the LSTM has one step graph")
        traced = set(runner.step._steps)
        fused = runner.max_fused_dense_tokens
        assert (0, True, False) in traced and (1, True, False) in traced, traced
        assert (0, True, True) in traced and (1, True, True) in traced, traced
        assert engine.engine.scheduler.cache.num_cached_blocks == 0

        async def three():
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            first = engine.generate(list(range(10, 11 + fused)), params, "a")
            await first.__anext__()  # its prompt ran alone; now one arrives as it decodes
            second = engine.generate(list(range(40, 41 + fused)), params, "b")
            async for _ in second:
                pass
            async for _ in first:
                pass
            async for _ in engine.generate([7, 8], params, "c"):  # short, alone
                pass
            third = engine.generate([9, 10], params, "d")
            await third.__anext__()  # a short one alone, now another while it decodes
            async for _ in engine.generate([11, 12], params, "e"):
                pass
            async for _ in third:
                pass

        asyncio.run(three())
        assert set(runner.step._steps) == traced
    finally:
        engine.shutdown()


def test_flat_step_call_matches_the_structured_call():
    """The step is called with its inputs flattened (skipping the signature binding); the
    result must be the public call's, and inputs that fit another step are refused."""
    import tensorflow as tf

    from tokenserve.engine.step.flat_call import FlatCall, spec as _spec

    @tf.function(input_signature=[_spec([None]), [(_spec([None, None]), _spec([None]))] * 2,
                                  (_spec([None]),), _spec([None])], autograph=False)
    def step(token_ids, groups, prefill, last):
        # every input feeds the result, each with its own weight, so a swap would show
        return (token_ids * 1000 + tf.reduce_sum(groups[0][0]) * 100
                + tf.reduce_sum(groups[1][1]) * 10 + tf.reduce_sum(prefill[0])
                - tf.reduce_sum(last) * 7 + tf.reduce_sum(groups[1][0]) * 3)

    concrete = step.get_concrete_function()
    rng = np.random.default_rng(0)
    args = (rng.integers(0, 9, 3, dtype=np.int32),
            [(rng.integers(0, 9, [2, 4], dtype=np.int32), rng.integers(0, 9, 2, dtype=np.int32)),
             (rng.integers(0, 9, [1, 5], dtype=np.int32), rng.integers(0, 9, 1, dtype=np.int32))],
            (rng.integers(0, 9, 6, dtype=np.int32),), rng.integers(0, 9, 2, dtype=np.int32))
    flat = FlatCall(concrete)
    assert flat._call_flat is not None  # the fast path, on the pinned TensorFlow
    np.testing.assert_array_equal(flat(*args).numpy(), concrete(*args).numpy())
    with pytest.raises(ValueError, match="traced for 7"):
        flat(args[0], args[1][:1], args[2], args[3])
