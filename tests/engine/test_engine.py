"""The continuous-batching engine's control flow on tiny real models (TensorFlow runner, real
SavedModels): outputs against full forward passes, aborts, preemption, seeds, stop strings,
streaming, the warm-up and broken logits. The step's internals (its paths, traces and
compiled programs) are tested in step/test_engine_step.py."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from support.engines import PROMPTS, engine_config
from support.tiny_models import reference_greedy, tiny
from tokenserve.engine.llm import LLM
from tokenserve.engine.outputs import FinishReason
from tokenserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def llms(exported):
    """(in-memory model, LLM with room to spare, LLM with a tiny cache) for each family."""
    model, config, version_dir = exported
    roomy = LLM(version_dir, engine_config())
    tight = LLM(version_dir, engine_config(max_cache_tokens=96))  # forces preemption
    return model, roomy, tight


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


@pytest.mark.parametrize("drafts", [0, pytest.param(3, marks=pytest.mark.slow)],
                         ids=["plain", "speculative"])
def test_a_model_that_makes_nan_logits_is_reported_and_keeps_serving(tokenizer, tmp_path,
                                                                      caplog, drafts):
    """A tiny GPT-2 with one token's (tied) embedding row set to NaN, as a corrupt checkpoint
    would have it: that token's logit is NaN at every step. Neither greedy rows (argmax
    alone would pick the NaN) nor sampled ones choose it; every such token is counted in
    StepStats and RequestStats, and the first of each request is logged (the start-up
    warmup's requests find it too, before any user does). With n-gram drafts (a prompt that
    repeats itself, so there are drafts to check), the tokens a step keeps after checking
    drafts are counted the same way, one each."""
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

        with caplog.at_level(logging.WARNING, logger="tokenserve.engine.output_processor"):
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


