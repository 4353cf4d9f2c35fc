"""A started engine moves start-up's objects out of the cycle collector's way (gc.freeze),
so no full collection over them falls due on the first requests; shutting it down hands
them back, so an unloaded version's cycles can be collected."""

from __future__ import annotations

import asyncio
import gc

from support.engines import ASYNC_CONFIG, collect
from tokenserve.engine.async_engine import AsyncEngine
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.runner import ModelRunner


def _tracked(obj) -> bool:
    """Whether the collector still walks `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_start_freezes_the_heap_and_shutdown_thaws_it(model_dir):
    gc.unfreeze()
    runner, tokenizer = ModelRunner.from_model_dir(model_dir, ASYNC_CONFIG)
    engine = AsyncEngine(LLMEngine(runner, tokenizer, ASYNC_CONFIG))
    assert gc.get_freeze_count() == 0 and _tracked(runner)
    engine.start()
    try:
        assert gc.get_freeze_count() > 0
        assert not _tracked(runner)  # the step's runner and its traced graphs are frozen
        outputs = asyncio.run(asyncio.wait_for(collect(engine, max_tokens=4), 30))
        assert outputs[-1].finished  # serving works on a frozen heap
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0 and _tracked(runner)


def test_collector_paused_freezes_what_the_block_made_and_restores_the_collector():
    from tokenserve.host.python_heap import collector_paused

    gc.unfreeze()
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # imports' long-lived objects stand-in
    try:
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)
        assert not _tracked(made[0])
        gc.disable()  # a caller that had the collector off keeps it off
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
    assert _tracked(made[0])
