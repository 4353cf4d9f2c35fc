"""--enable_batching for plain SavedModels: concurrent calls share one batched call, split
back by rows; a bad call in a batch fails alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.batching import BatchingServable
from tokenserve.lifecycle.server_protos import BatchingParameters


class Doubler:
    """y = 2x; refuses negative inputs; records the batch sizes it ran."""

    def __init__(self):
        self.path = Path("/fake")
        self.signature_defs = {}
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def run(self, signature_name, inputs, output_keys=None, timeout_s=None):
        x = inputs["x"]
        with self.lock:
            self.batches.append(len(x) if np.ndim(x) else 0)
        if np.any(x < 0):
            raise InvalidRequestError("negative input")
        return {"y": x * 2}

    def close(self):
        pass


def run_concurrently(servable, inputs_list):
    with ThreadPoolExecutor(len(inputs_list)) as pool:
        futures = [pool.submit(servable.run, "serving_default", {"x": x}) for x in inputs_list]
        return [f.exception() or f.result() for f in futures]


def test_concurrent_calls_become_one_batch_and_split_back():
    inner = Doubler()
    # A long timeout: the batch runs only when it is full, so exactly one call is made.
    servable = BatchingServable(inner, BatchingParameters(max_batch_size=6,
                                                         batch_timeout_micros=30_000_000,
                                                         num_batch_threads=1))
    inputs = [np.array([[1.0, 1.0]]), np.array([[2.0, 2.0], [3.0, 3.0]]),
              np.array([[4.0, 4.0], [5.0, 5.0], [6.0, 6.0]])]
    results = run_concurrently(servable, inputs)
    assert inner.batches == [6]
    for x, result in zip(inputs, results):
        assert result["y"].tolist() == (x * 2).tolist()
    servable.close()


def test_bad_call_in_a_batch_fails_alone_and_padding():
    inner = Doubler()
    servable = BatchingServable(inner, BatchingParameters(
        max_batch_size=4, batch_timeout_micros=30_000_000, num_batch_threads=1,
        allowed_batch_sizes=(4,)))
    results = run_concurrently(servable, [np.array([1.0]), np.array([-1.0]),
                                          np.array([2.0, 3.0])])
    assert results[0]["y"].tolist() == [2.0]
    assert isinstance(results[1], InvalidRequestError)
    assert results[2]["y"].tolist() == [4.0, 6.0]
    assert inner.batches[0] == 4 and sorted(inner.batches[1:]) == [1, 1, 2]
    servable.close()


def test_unbatchable_calls_run_directly():
    inner = Doubler()
    servable = BatchingServable(inner, BatchingParameters(max_batch_size=2,
                                                         batch_timeout_micros=30_000_000))
    assert servable.run("s", {"x": np.array(3.0)})["y"] == 6.0  # scalar: no batch dimension
    assert servable.run("s", {"x": np.arange(3.0)})["y"].tolist() == [0.0, 2.0, 4.0]  # > max
    assert inner.batches == [0, 3]
    servable.close()
    with pytest.raises(InvalidRequestError):
        lone = BatchingServable(Doubler(), BatchingParameters())
        try:
            lone.run("s", {"x": np.array([-1.0])})
        finally:
            lone.close()
