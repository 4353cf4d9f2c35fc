"""The continuous-batching engine on tiny real models (TensorFlow runner, real SavedModels)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np
import pytest

from tokenserve.engine import runner as runner_module
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.llm import LLM
from tokenserve.engine.outputs import FinishReason
from tokenserve.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "import os", "class Point:\n    def", "for item in items:\n",
           "x", "PATH = os.path.join('a', 'b')  # ünïcödé"]


def engine_config(**options) -> EngineConfig:
    # the fused dense ops' share pinned, so the same steps take each path on every CPU
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=24, block_size=4, precision="float32",
                    max_fused_dense_tokens=4)
    return EngineConfig(**{**defaults, **options})


@pytest.fixture(scope="module")
def llms(exported):
    """(in-memory model, LLM with room to spare, LLM with a tiny cache) for each family."""
    model, config, version_dir = exported
    roomy = LLM(version_dir, engine_config())
    tight = LLM(version_dir, engine_config(max_cache_tokens=96))  # forces preemption
    return model, roomy, tight


def reference_greedy(model, prompt_ids: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy decoding with full forward passes and no cache at all."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        token = int(np.argmax(model(np.asarray([ids], np.int32)).numpy()[0, -1]))
        ids.append(token)
        if token == eos:
            break
    return ids[len(prompt_ids):]


def test_greedy_engine_output_equals_full_forward_passes(llms):
    model, llm, _ = llms
    params = SamplingParams(max_tokens=12)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == reference_greedy(model, ids, 12,
                                                            llm.engine.config.eos_token_id)


def test_an_abort_while_the_step_computes_leaves_that_step_and_the_others_intact(llms):
    """The async engine computes a step without its lock, so a client that leaves can free
    its sequence's blocks between schedule() and execute(). The step must compute what was
    scheduled (before, it read the emptied block list: an attention op failed on a context of
    no rows, and with no running request left to blame, the engine stopped)."""
    model, llm, _ = llms
    engine = llm.engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    requests = [engine.make_request(ids, params, f"leaves-{i}")
                for i, ids in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    engine.step()  # both prompts' prefill: both decode from here
    _, scheduled = engine.schedule()
    assert len(scheduled.scheduled) == 2
    engine.abort("leaves-0")
    assert requests[0].seqs[0].block_ids == []  # what the step used to read
    engine.update(scheduled, engine.execute(scheduled))
    while engine.has_work:
        engine.step()
    assert requests[0].seqs[0].num_output_tokens == 1
    assert requests[1].seqs[0].output_ids == reference_greedy(model, prompts[1], 6, -1)


def test_an_abort_that_no_step_follows_still_moves_the_queue_gauges(llms):
    """A client that leaves while its request is the last one: the engine goes idle and no
    step reports the emptied queues, so the abort itself must (the gauges had stayed at one
    running request and its cache share until the next request came)."""
    from prometheus_client import CollectorRegistry

    from tokenserve.observability.llm_metrics import LLMMetrics

    _, llm, _ = llms
    engine = llm.engine
    registry = CollectorRegistry()
    labels = {"model_name": engine.model_name, "model_version": engine.version}

    def gauge(name: str) -> float | None:
        return registry.get_sample_value(name, labels)

    saved, engine.stats = engine.stats, LLMMetrics(registry)
    try:
        engine.add_request(engine.make_request(llm.tokenizer.encode(PROMPTS[0]),
                                               SamplingParams(max_tokens=6, ignore_eos=True),
                                               "leaves-last"))
        engine.step()
        assert gauge("vllm:num_requests_running") == 1
        assert gauge("vllm:kv_cache_usage_perc") > 0
        engine.abort("leaves-last")
        assert not engine.has_work
        assert gauge("vllm:num_requests_running") == 0
        assert gauge("vllm:num_requests_waiting") == 0
        assert gauge("vllm:kv_cache_usage_perc") == 0
        assert registry.get_sample_value("vllm:request_success_total",
                                         {**labels, "finished_reason": "abort"}) == 1
    finally:
        engine.stats = saved


def test_greedy_output_is_the_same_alone_and_in_a_busy_mixed_batch(llms):
    _, llm, _ = llms
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed_params = [SamplingParams(max_tokens=m, temperature=t, seed=1, ignore_eos=True)
                    for m, t in [(5, 0.9), (30, 1.2), (16, 0.0), (3, 0.0), (9, 0.7), (20, 0.0)]]
    busy = llm.generate(PROMPTS, mixed_params, use_tqdm=False)
    assert busy[2].outputs[0].token_ids == alone


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


def test_greedy_output_is_exact_when_decode_runs_in_several_context_groups(llms, monkeypatch):
    model, llm, _ = llms
    runner = llm.engine.runner  # split at every length change
    monkeypatch.setattr(runner, "engine_config",
                        dataclasses.replace(runner.engine_config, decode_group_cost_rows=0))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, n).tolist() for n in (3, 40, 70, 100, 35, 8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == reference_greedy(model, prompt, 10, eos=-1)


def test_preemption_by_recompute_keeps_outputs_identical(llms):
    _, roomy, tight = llms
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params, use_tqdm=False)]
    if tight.engine.runner.is_transformer:
        assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.scheduler.cache.usage == 0.0


def test_a_fixed_seed_reproduces_a_sampled_output_whatever_the_batch(llms):
    _, llm, _ = llms
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7,
                            ignore_eos=True)
    first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [params] + [SamplingParams(max_tokens=8, temperature=1.0)] * 4
    second = llm.generate(PROMPTS[:5], crowd, use_tqdm=False)[0].outputs[0].token_ids
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=8, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert first == second
    assert other_seed != first


def spanning_stop(pieces: list[str]) -> tuple[str, int] | None:
    """A string whose first occurrence in the text straddles a token boundary, and where
    it starts; pieces[i] is the text of the first i generated tokens."""
    for i in range(1, len(pieces) - 1):
        before, after = pieces[i], pieces[i + 1]
        if len(after) <= len(before) or len(before) <= len(pieces[i - 1]):
            continue
        for take in (2, 1):
            stop = before[max(len(pieces[i - 1]), len(before) - take):] + after[len(before)]
            cut = after.find(stop)
            if stop not in before and cut + len(stop) > len(before) > cut:
                return stop, cut
    return None


def test_a_stop_string_spanning_a_token_boundary_is_honoured(llms):
    _, llm, _ = llms
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        full = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        pieces = [llm.tokenizer.decode(full.token_ids[:i])
                  for i in range(len(full.token_ids) + 1)]
        if found := spanning_stop(pieces):
            break
    stop, cut = found
    out = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == full.text[:cut]


def test_n_logprobs_and_length_finish(llms):
    _, llm, _ = llms
    params = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3, logprobs=3,
                            ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    for completion in out.outputs:
        assert completion.finish_reason is FinishReason.LENGTH
        assert len(completion.logprobs) == 6 == len(completion.token_ids)
        for lp, token in zip(completion.logprobs, completion.token_ids):
            assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
            values = [value for _, value in lp.top]
            assert values == sorted(values, reverse=True)  # most likely first, always
            top = dict(lp.top)
            if token in top:  # the sampled token's own entry carries its logprob
                assert top[token] == pytest.approx(lp.logprob)
            else:  # a token outside the top 3 is no likelier than the third
                assert lp.logprob <= values[-1] + 1e-9
    assert out.num_generated_tokens == 12


def test_graph_attention_gives_the_fused_ops_greedy_tokens(exported, llms, monkeypatch):
    """Where the paged-attention op cannot be built, the graph path must agree with it."""
    model, llm, _ = llms
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


def test_fused_dense_ops_give_the_xla_paths_greedy_tokens(exported, llms):
    """Steps of a few tokens run the dense half as fused ops, larger ones through XLA: both
    must give the same tokens, alone and in mixed batches (prefill chunks beside decodes)."""
    _, llm, _ = llms
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
    """Left on auto, the runner takes the CPU's choice (tests/test_cpu_choices.py), says so,
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


def test_the_step_does_not_retrace_for_new_shapes(llms):
    _, llm, _ = llms
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


def test_xla_dense_layers_compile_once_per_token_bucket(llms):
    _, llm, _ = llms
    if not llm.engine.runner.is_transformer:
        pytest.skip("the LSTM step has no dense XLA blocks")
    step = llm.engine.runner.step
    assert step.jit_dense  # float32 runs its dense layers through XLA
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5), use_tqdm=False)
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


def test_async_engine_streams_deltas_and_a_cancelled_stream_frees_its_capacity(exported):
    from tokenserve.engine.async_engine import AsyncEngine

    _, _, version_dir = exported
    engine = AsyncEngine.from_model_dir(version_dir, engine_config())
    ids = engine.tokenizer.encode(PROMPTS[0])
    try:
        async def stream_all():
            text, tokens = "", []
            async for out in engine.generate(ids, SamplingParams(max_tokens=10), "full"):
                text += out.outputs[0].text if out.outputs else ""
                tokens += out.outputs[0].token_ids if out.outputs else []
            return text, tokens

        async def cancel_early():
            stream = engine.generate(ids, SamplingParams(max_tokens=100, ignore_eos=True), "gone")
            async for _ in stream:
                break
            await stream.aclose()  # what a dropped client's server does
            for _ in range(100):
                if engine.num_unfinished == 0:
                    return True
                await asyncio.sleep(0.01)
            return False

        async def deltas_of(request_id, final_only):
            """(deltas, how many arrived while the request still ran)."""
            deltas, early = [], 0
            async for out in engine.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True),
                                             request_id, final_only=final_only):
                early += engine.num_unfinished > 0
                deltas.append(out)
            return deltas, early

        text, tokens = asyncio.run(stream_all())
        assert tokens and text == engine.tokenizer.decode(tokens)
        # final_only: the same deltas (one per step, the last one finished), all handed over
        # once the request is done, none while it runs
        plain, plain_early = asyncio.run(deltas_of("plain", False))
        held, held_early = asyncio.run(deltas_of("held", True))
        assert plain_early > 0 and held_early == 0
        assert [d.finished for d in held] == [False] * 9 + [True]
        assert ([d.outputs[0].token_ids for d in held]
                == [d.outputs[0].token_ids for d in plain])
        assert asyncio.run(cancel_early())
        assert engine.engine.scheduler.cache.usage == 0.0
        assert engine.is_ready()
    finally:
        engine.shutdown()


def test_the_start_up_warmup_request_reaches_no_stats(exported):
    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.stats import StatsSink

    class Recorder(StatsSink):
        def __init__(self):
            self.requests, self.steps = [], []

        def on_request(self, stats):
            self.requests.append(stats)

        def on_step(self, stats):
            self.steps.append(stats)

    _, _, version_dir = exported
    recorder = Recorder()
    engine = AsyncEngine.from_model_dir(version_dir, engine_config(), stats=recorder)
    try:
        assert engine.is_ready() and engine.engine.num_steps > 0  # the warmup did run
        assert recorder.requests == [] and recorder.steps == []

        async def one():
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=3,
                                                                     ignore_eos=True), "user"):
                pass

        asyncio.run(one())
        assert [(r.request_id, r.num_generation_tokens) for r in recorder.requests] == [
            ("user", 3)]
        assert recorder.steps
    finally:
        engine.shutdown()


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "speculative"])
def test_a_model_that_makes_nan_logits_is_reported_and_keeps_serving(tokenizer, tmp_path,
                                                                      caplog, drafts):
    """A tiny GPT-2 with one token's (tied) embedding row set to NaN, as a corrupt checkpoint
    would have it: that token's logit is NaN at every step. Neither greedy rows (argmax
    alone would pick the NaN) nor sampled ones choose it; every such token is counted in
    StepStats and RequestStats, and the first of each request is logged (the start-up
    warmup's requests find it too, before any user does). With n-gram drafts (a prompt that
    repeats itself, so there are drafts to check), the tokens a step keeps after checking
    drafts are counted the same way, one each."""
    from conftest import tiny

    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.export.exporter import export_model
    from tokenserve.stats import StatsSink

    class Recorder(StatsSink):
        def __init__(self):
            self.requests, self.steps = {}, []

        def on_request(self, stats):
            self.requests[stats.request_id] = stats

        def on_step(self, stats):
            self.steps.append(stats)

    model, config = tiny("tiny-gpt2", tokenizer)
    broken_token = 123
    table = model.token_embedding.numpy()
    table[broken_token] = np.nan
    model.token_embedding.assign(table)
    prompt = [t for t in range(5, 15) if t != broken_token] * (3 if drafts else 1)
    recorder = Recorder()
    engine = AsyncEngine.from_model_dir(export_model(model, tokenizer, config, tmp_path),
                                        engine_config(num_speculative_tokens=drafts),
                                        stats=recorder)
    try:
        async def run(request_id, params):
            tokens = []
            async for out in engine.generate(prompt, params, request_id):
                tokens += out.outputs[0].token_ids
            return tokens

        with caplog.at_level(logging.WARNING, logger="tokenserve.engine.core"):
            greedy = asyncio.run(run("greedy", SamplingParams(max_tokens=6, ignore_eos=True)))
            sampled = asyncio.run(run("sampled", SamplingParams(
                max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)))
        assert broken_token not in greedy and len(greedy) == 6
        assert broken_token not in sampled and len(sampled) == 6
        assert recorder.requests["greedy"].num_nonfinite_logits == 6
        assert recorder.requests["sampled"].num_nonfinite_logits == 6
        assert sum(step.num_nonfinite_logits for step in recorder.steps) == 12
        warnings = [r.getMessage() for r in caplog.records if "held NaN or +inf" in r.getMessage()]
        users = [w for w in warnings if "request greedy" in w or "request sampled" in w]
        assert len(users) == 2 and "token 0 of request greedy" in users[0], warnings
        assert len(warnings) > 2  # the warmup's
        assert (engine.engine.num_draft_tokens > 0) == bool(drafts)
        assert engine.is_ready()
    finally:
        engine.shutdown()


def test_a_healthy_model_reports_no_nonfinite_logits(exported):
    from tokenserve.engine.async_engine import AsyncEngine
    from tokenserve.stats import StatsSink

    class Recorder(StatsSink):
        def __init__(self):
            self.counts = []

        def on_request(self, stats):
            self.counts.append(stats.num_nonfinite_logits)

        def on_step(self, stats):
            self.counts.append(stats.num_nonfinite_logits)

    _, _, version_dir = exported
    recorder = Recorder()
    engine = AsyncEngine.from_model_dir(version_dir, engine_config(), stats=recorder)
    try:
        async def both():
            for params in (SamplingParams(max_tokens=5, ignore_eos=True),
                           SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9,
                                          ignore_eos=True)):
                async for _ in engine.generate([5, 6, 7], params, f"r{params.temperature}"):
                    pass

        asyncio.run(both())
        assert recorder.counts and not any(recorder.counts)
    finally:
        engine.shutdown()


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


def test_the_warmup_fits_a_queue_limit_below_its_prompts(exported):
    """An engine whose queue admits 3 prompt tokens still starts: the warm-up's prompts
    shrink to what the queue takes, and the second is skipped when it does not fit."""
    from tokenserve.engine.async_engine import AsyncEngine

    _, _, version_dir = exported
    engine = AsyncEngine.from_model_dir(version_dir, engine_config(max_num_seqs=1,
                                                                   max_queue_tokens=3))
    try:
        assert engine.is_ready() and engine.engine.num_steps > 0
        assert engine.engine.scheduler.num_waiting_requests == 0
    finally:
        engine.shutdown()


def test_flat_step_call_matches_the_structured_call():
    """The step is called with its inputs flattened (skipping the signature binding); the
    result must be the public call's, and inputs that fit another step are refused."""
    import tensorflow as tf

    from tokenserve.engine.tf_step import FlatCall, _spec

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


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama"])
def bf16_exact(request, tokenizer, tmp_path_factory):
    """A tiny transformer whose float32 weights are all bfloat16 values, exported."""
    import tensorflow as tf

    from conftest import tiny
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
    from tokenserve.engine import tf_step

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
    (engine/screened_head.py), which recomputes the candidates from the widened bfloat16
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
    from tokenserve.engine import tf_step

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
