"""The lifecycle under trouble: a config refused for a passing reason is applied once it can
be, an unload cannot hang on a leaked hold (or on a stream whose close fails), polling does
not stall requests while it walks directories, and observers (the LLM metrics) see every
state change, load and warmup, with no series left for unloaded versions."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from support.fake_loader import FakeLoader, make_version, states
from tokenserve.lifecycle import ModelManager, ModelSpecConfig, VersionPolicy, VersionState
from tokenserve.lifecycle.model_config import read_model_config_file
from tokenserve.lifecycle.poller import Poller
from tokenserve.lifecycle.repository import fingerprint
from tokenserve.observability.llm_metrics import LLMMetrics
from tokenserve.server.openai.http import EventStream
from tokenserve.stats import StepStats


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def config_text(base, labels: dict[str, int]) -> str:
    label_text = "".join(f' version_labels {{ key: "{k}" value: {v} }}'
                         for k, v in labels.items())
    return (f'model_config_list {{ config {{ name: "m" base_path: "{base}" '
            f'model_platform: "tensorflow" model_version_policy {{ all {{}} }}{label_text} }} }}')


def test_a_refused_config_is_applied_at_a_later_poll(tmp_path):
    """The label names version 2 while it is still loading: refused (TF Serving's rule),
    and applied at the next poll after version 2 is AVAILABLE, without the file changing."""
    base = tmp_path / "m"
    make_version(base, 1)
    config_file = tmp_path / "models.config"
    config_file.write_text(config_text(base, {}))
    loader = FakeLoader()
    manager = ModelManager(loader, max_num_load_retries=0)
    manager.apply_config(read_model_config_file(config_file))
    loader.gate = threading.Event()  # version 2's load waits
    make_version(base, 2)
    manager.poll()
    assert wait_for(lambda: states(manager, "m").get(2) == VersionState.LOADING)
    reads = []

    def read_config():
        reads.append(1)
        return read_model_config_file(config_file)

    poller = Poller(manager, 0, read_config, 0.05)  # its first read: the file before the edit
    config_file.write_text(config_text(base, {"stable": 2}))  # the edit the poller sees
    try:
        poller.start()
        # several polls, each one refused: a read follows the previous poll's apply
        assert wait_for(lambda: len(reads) >= 5)
        assert manager.labels("m") == {}
        loader.gate.set()
        assert wait_for(lambda: manager.labels("m") == {"stable": 2})
        with manager.acquire("m", label="stable") as version:
            assert version.version == 2
    finally:
        poller.stop()
        manager.close(timeout_s=5)


def test_an_unload_ends_even_when_a_hold_never_comes_back(tmp_path):
    loader = FakeLoader()
    manager = ModelManager(loader, unload_drain_timeout_s=0.3)
    base = tmp_path / "m"
    make_version(base, 1)
    manager.apply_config([ModelSpecConfig("m", str(base), policy=VersionPolicy.latest(1))])
    leaked = manager.acquire("m")
    old = leaked.__enter__()  # a hold that is never released (a leak)
    make_version(base, 2)
    manager.poll()
    assert wait_for(lambda: states(manager, "m") == {2: VersionState.AVAILABLE,
                                                     1: VersionState.END})
    assert old.servable is None  # torn down: its resources are freed
    manager.close(timeout_s=5)


def test_a_stream_whose_close_fails_still_releases_its_model_version():
    """EventStream's on_close (which releases the version the stream holds) runs even when
    closing the event generator raises."""
    released = []

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(3600)
        finally:
            raise RuntimeError("closing the stream failed")

    async def on_close():
        released.append(True)

    async def scenario():
        sent = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sent.set()
                await asyncio.Event().wait()  # a client that stopped reading: the generator
                # waits at its yield, so only closing it runs its failing `finally`

        async def receive():
            await sent.wait()
            return {"type": "http.disconnect"}

        stream = EventStream(events(), on_close=on_close)
        with pytest.raises(RuntimeError, match="closing the stream failed"):
            await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert released == [True]


def test_polling_does_not_hold_the_lock_requests_need_while_it_walks_directories(tmp_path):
    """A failed version is fingerprinted at every poll (to retry it once its files change);
    with 20,000 files that walk takes a while, and acquire() on any model must not wait."""
    loader = FakeLoader()
    manager = ModelManager(loader, max_num_load_retries=0)
    big = make_version(tmp_path / "big", 1, fail=True)
    for i in range(20_000):
        (big / f"shard-{i}").touch()
    make_version(tmp_path / "small", 1)
    manager.apply_config([ModelSpecConfig("small", str(tmp_path / "small")),
                          ModelSpecConfig("big", str(tmp_path / "big"))])
    assert states(manager, "big") == {1: VersionState.END}
    started = time.perf_counter()
    fingerprint(big)
    walk_s = time.perf_counter() - started
    stop, worst = threading.Event(), [0.0]

    def poll_repeatedly():
        while not stop.is_set():
            manager.poll()

    poller = threading.Thread(target=poll_repeatedly)
    poller.start()
    try:
        deadline = time.monotonic() + max(3 * walk_s, 1.0)
        while time.monotonic() < deadline:
            started = time.perf_counter()
            with manager.acquire("small"):
                pass
            worst[0] = max(worst[0], time.perf_counter() - started)
            time.sleep(0.005)
    finally:
        stop.set()
        poller.join(30)
        manager.close(timeout_s=5)
    assert worst[0] < walk_s / 3, (worst[0], walk_s)


def test_metrics_follow_a_real_load_swap_and_unload(tmp_path):
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    loader = FakeLoader()
    manager = ModelManager(loader, warmup=lambda version: time.sleep(0.01))
    manager.add_observer(metrics)
    base = tmp_path / "m"
    make_version(base, 1)
    manager.apply_config([ModelSpecConfig("m", str(base), policy=VersionPolicy.latest(1))])

    def sample(name: str, **labels) -> float | None:
        return registry.get_sample_value(name, labels)

    def state(version: str, name: str) -> float | None:
        return sample("tokenserve:model_version_state", model_name="m", model_version=version,
                      state=name)

    assert state("1", "AVAILABLE") == 1 and state("1", "LOADING") == 0
    assert sample("tokenserve:model_load_latency_seconds_count", model_name="m",
                  model_version="1") == 1
    assert sample("tokenserve:model_warmup_latency_seconds_count", model_name="m",
                  model_version="1") == 1
    metrics.on_step(StepStats(model="m", version="1", time=0.0, duration_s=0.01,
                              num_running=3, num_waiting=1, num_batched_tokens=3,
                              num_prefill_tokens=0, num_decode_tokens=3, cache_usage=0.5))
    assert sample("vllm:num_requests_running", model_name="m", model_version="1") == 3
    make_version(base, 2)
    manager.poll()  # the swap: 2 loads, then 1 unloads
    assert wait_for(lambda: state("1", "END") == 1 and state("2", "AVAILABLE") == 1)
    assert state("1", "AVAILABLE") == 0 and state("2", "LOADING") == 0
    text = generate_latest(registry).decode()
    assert 'vllm:num_requests_running{model_name="m",model_version="1"}' not in text
    assert 'vllm:kv_cache_usage_perc{model_name="m",model_version="1"}' not in text
    manager.close(timeout_s=5)  # the last unload
    assert state("2", "END") == 1
