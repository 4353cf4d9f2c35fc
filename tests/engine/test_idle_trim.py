"""The engine trims its heap (malloc_trim) once it has been idle a while after work: the
steps' freed temporaries go back to the OS between bursts instead of staying resident."""

from __future__ import annotations

import asyncio

import pytest

from support.engines import ASYNC_CONFIG, collect
from support.waiting import wait_until
from tokenserve.engine.async_engine import AsyncEngine
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.runner import ModelRunner
from tokenserve.errors import ConfigError


class LoopWaits:
    """Watches the engine loop's waits: `parked` is true while the loop waits for work with
    no timeout, so that no idle trim can fall due before a request arrives."""

    def __init__(self, engine: AsyncEngine):
        self._wait = engine._wake.wait
        self._timeout: float | None | str = "running"
        engine._wake.wait = self._watched_wait

    def _watched_wait(self, timeout: float | None = None):
        self._timeout = timeout
        try:
            return self._wait(timeout)
        finally:
            self._timeout = "running"

    @property
    def parked(self) -> bool:
        return self._timeout is None


def test_an_idle_engine_trims_its_heap_once_after_work_and_not_while_busy(model_dir,
                                                                         monkeypatch):
    import tokenserve.engine.async_engine as async_engine

    trims = []
    monkeypatch.setattr(async_engine, "release_freed_memory", lambda: trims.append(1))
    config = ASYNC_CONFIG.replace(idle_trim_s=0.2)
    runner, tokenizer = ModelRunner.from_model_dir(model_dir, config)
    engine = AsyncEngine(LLMEngine(runner, tokenizer, config))
    loop = LoopWaits(engine)
    engine.start()
    try:
        assert trims == []  # warmup ran on the caller's thread: no trim before any request
        outputs = asyncio.run(asyncio.wait_for(collect(engine, max_tokens=8), 30))
        assert outputs[-1].finished and trims == []  # within 0.2 s of the last step
        # once per idle period, not every 0.2 s: after its trim the loop waits for work alone
        assert wait_until(lambda: trims == [1] and loop.parked), trims
        outputs = asyncio.run(asyncio.wait_for(collect(engine), 30))
        assert outputs[-1].outputs[0].finish_reason.value == "length"
        assert wait_until(lambda: trims == [1, 1] and loop.parked), trims
    finally:
        engine.shutdown()


def test_idle_trim_s_none_never_trims_and_a_negative_one_is_refused(model_dir, monkeypatch):
    import tokenserve.engine.async_engine as async_engine

    trims = []
    monkeypatch.setattr(async_engine, "release_freed_memory", lambda: trims.append(1))
    config = ASYNC_CONFIG.replace(idle_trim_s=None)
    runner, tokenizer = ModelRunner.from_model_dir(model_dir, config)
    engine = AsyncEngine(LLMEngine(runner, tokenizer, config))
    loop = LoopWaits(engine)
    engine.start()
    try:
        asyncio.run(asyncio.wait_for(collect(engine), 30))
        # idle after its work with no timer running: no trim can come before the next request
        assert wait_until(lambda: loop.parked)
        assert trims == []
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError):
        EngineConfig(idle_trim_s=-1.0)
