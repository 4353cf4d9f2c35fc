"""The engine under failure: a loop that cannot go on dies loudly (every request fails with
EngineDeadError, new ones are refused, readiness drops, one log line) instead of hanging its
streams; shutdown never strands a request; models build with their own dtype when versions
load at once (Keras keeps the dtype policy per thread); offline generation takes any number
of prompts.

Real tiny models; failures are injected by subclassing the synchronous engine (the loop
code under test is AsyncEngine's own).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import keras
import pytest

from support.engines import ASYNC_CONFIG, collect
from tokenserve.engine.async_engine import AsyncEngine
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.llm import LLM
from tokenserve.engine.runner import ModelRunner
from tokenserve.errors import EngineDeadError
from tokenserve.sampling import SamplingParams


class FaultyEngine(LLMEngine):
    """An LLMEngine whose schedule, execute or abort raise while their flag is set, and
    whose make_request can run a hook (to interleave another thread's call)."""

    fail_schedule = fail_execute = fail_abort = False
    on_make_request = None
    schedule_calls = 0

    def schedule(self):
        self.schedule_calls += 1
        if self.fail_schedule:
            raise RuntimeError("schedule broke")
        return super().schedule()

    def execute(self, scheduled):
        if self.fail_execute:
            raise RuntimeError("execute broke")
        return super().execute(scheduled)

    def abort(self, request_id):
        if self.fail_abort:
            raise RuntimeError("abort broke")
        return super().abort(request_id)

    def make_request(self, *args, **kwargs):
        request = super().make_request(*args, **kwargs)
        if self.on_make_request is not None:
            self.on_make_request()
        return request


def faulty_engine(model_dir) -> tuple[AsyncEngine, FaultyEngine]:
    runner, tokenizer = ModelRunner.from_model_dir(model_dir, ASYNC_CONFIG)
    core = FaultyEngine(runner, tokenizer, ASYNC_CONFIG)
    engine = AsyncEngine(core)
    engine.start()
    return engine, core


def test_a_step_failure_fails_only_its_requests_and_the_engine_goes_on(model_dir):
    engine, core = faulty_engine(model_dir)
    try:
        core.fail_execute = True
        outputs = asyncio.run(asyncio.wait_for(collect(engine), 30))
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason.value == "abort"
        assert not engine.is_ready()  # its last step failed
        core.fail_execute = False
        outputs = asyncio.run(asyncio.wait_for(collect(engine), 30))
        assert outputs[-1].outputs[0].finish_reason.value == "length"
        assert engine.is_ready()
    finally:
        engine.shutdown()


def test_a_loop_that_dies_fails_its_streams_refuses_new_work_and_logs_once(model_dir,
                                                                          caplog):
    engine, core = faulty_engine(model_dir)

    async def scenario():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True),
                                 "long")
        first = await stream.__anext__()  # running
        assert not first.finished
        # the next step fails, and failing its request fails too: the loop cannot go on
        core.fail_execute = core.fail_abort = True
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine)

    try:
        with caplog.at_level(logging.CRITICAL, logger="tokenserve.engine.async_engine"):
            asyncio.run(asyncio.wait_for(scenario(), 30))
        assert not engine.is_ready()
        deaths = [r for r in caplog.records if r.levelno == logging.CRITICAL]
        assert len(deaths) == 1 and "abort broke" in deaths[0].getMessage()
    finally:
        core.fail_abort = False
        engine.shutdown()


def test_a_schedule_failure_with_only_waiting_requests_kills_the_engine_not_the_cpu(
        model_dir):
    """Nothing runs, so nothing can be failed: before, the loop retried the same failing
    schedule() in a hot loop and the request waited forever."""
    engine, core = faulty_engine(model_dir)
    try:
        core.fail_schedule = True
        calls_before = core.schedule_calls
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(collect(engine), 30))
        assert core.schedule_calls - calls_before <= 2  # no spinning
        assert not engine.is_ready()
    finally:
        core.fail_schedule = False
        engine.shutdown()


def test_a_request_that_arrives_while_shutting_down_is_refused_not_stranded(model_dir):
    """shutdown() lands between generate()'s checks and its add_request (the window the old
    unlocked `_stopped` check left open): the request must fail at once, not wait forever
    on a loop that has stopped."""
    engine, core = faulty_engine(model_dir)
    core.on_make_request = engine.shutdown
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(asyncio.wait_for(collect(engine), 30))
    assert engine.num_unfinished == 0


def test_the_keras_dtype_policy_is_per_thread():
    """Why versions may load on threads of their own: build_model sets Keras's "global"
    dtype policy while it builds, and Keras 3 keeps that policy per thread, so one version's
    bfloat16 build never leaks into another's (docs/architecture.md#the-life-of-a-version)."""
    seen = []
    keras.mixed_precision.set_global_policy("bfloat16")
    try:
        thread = threading.Thread(
            target=lambda: seen.append(keras.mixed_precision.global_policy().name))
        thread.start()
        thread.join()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert seen == ["float32"]


def test_versions_loading_at_once_build_with_their_own_dtype(model_dir):
    """The end-to-end form: six versions of mixed precision built at once."""
    assert keras.mixed_precision.global_policy().name == "float32"
    precisions = ["bfloat16", "float32"] * 3
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(precisions))

    def load(index: int, precision: str) -> None:
        try:
            start.wait()
            runner, _ = ModelRunner.from_model_dir(model_dir,
                                                   ASYNC_CONFIG.replace(precision=precision))
            results[index] = runner.precision
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=load, args=(i, p)) for i, p in enumerate(precisions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors
    assert [results[i] for i in range(len(precisions))] == precisions
    assert keras.mixed_precision.global_policy().name == "float32"


def test_offline_generation_takes_more_prompts_than_the_queue_and_calls_again(model_dir):
    llm = LLM(model_dir, ASYNC_CONFIG, max_queue_requests=3)
    prompts = [[5, 6, 7 + i] for i in range(10)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in first] == prompts
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in first)
    second = llm.generate(prompts[:4], params, use_tqdm=False)  # no request-id collision
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids
                                                         for o in first[:4]]
    assert not {o.request_id for o in first} & {o.request_id for o in second}
    assert not llm.engine.has_work
