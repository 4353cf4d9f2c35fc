"""--enable_batching under load: queues are bounded by max_enqueued_batches (a call beyond it
is refused at once, as TF Serving refuses it) and a queue leaves no trace once drained (its
key holds input shapes, which clients choose)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tokenserve.errors import QueueFullError
from tokenserve.lifecycle.batching import BatchingServable
from tokenserve.lifecycle.server_protos import BatchingParameters
from tokenserve.server.status import grpc_code, http_status


class Gated:
    """y = x + 1, holding every call until `gate` is set; `started` is set on the first."""

    def __init__(self):
        self.path = Path("/fake")
        self.signature_defs = {}
        self.gate, self.started = threading.Event(), threading.Event()

    def run(self, signature_name, inputs, output_keys=None, timeout_s=None):
        self.started.set()
        assert self.gate.wait(30)
        return {"y": inputs["x"] + 1}

    def close(self):
        pass


def test_a_call_beyond_max_enqueued_batches_is_refused_at_once():
    inner = Gated()
    servable = BatchingServable(inner, BatchingParameters(
        max_batch_size=2, max_enqueued_batches=1, batch_timeout_micros=30_000_000,
        num_batch_threads=1))
    one_row = {"x": np.array([[1.0]])}
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(servable.run, "serving_default", one_row) for _ in range(2)]
        assert inner.started.wait(10)  # that full batch runs (and blocks) on the only thread
        waiting = [pool.submit(servable.run, "serving_default", one_row) for _ in range(2)]
        deadline = time.monotonic() + 10
        while sum(len(calls) for calls in servable._queues.values()) < 2:
            assert time.monotonic() < deadline and not any(f.done() for f in waiting)
            time.sleep(0.01)
        with pytest.raises(QueueFullError, match="batch scheduling queue .* is full"):
            servable.run("serving_default", one_row)  # a third waiting row: over 1 x 2
        inner.gate.set()
        for future in running + waiting:
            assert future.result(30)["y"].tolist() == [[2.0]]
    servable.close()
    error = QueueFullError("full")
    assert (http_status(error), grpc_code(error).name) == (429, "RESOURCE_EXHAUSTED")


def test_drained_queues_leave_no_keys_behind():
    inner = Gated()
    inner.gate.set()
    servable = BatchingServable(inner, BatchingParameters(max_batch_size=4,
                                                         num_batch_threads=1))
    for width in range(1, 60):  # 59 input shapes, 59 queues while they wait
        result = servable.run("serving_default", {"x": np.zeros([1, width])})
        assert result["y"].shape == (1, width)
    assert servable._queues == {}
    servable.close()
