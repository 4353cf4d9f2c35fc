"""`--enable_batching` for plain SavedModels: concurrent calls become one batched call.

Calls on the same signature, asking for the same outputs, whose inputs agree on dtype and on
every dimension but the first (the batch dimension), are concatenated along dimension 0, run
once, and the outputs are split back by rows. A call that cannot be batched (a scalar input,
inputs with different first dimensions, more rows than `max_batch_size`) runs on its own. If a
batched call fails, each call in it is retried alone, so one bad request fails only itself.
Plain Python and NumPy; the wrapped servable does the TensorFlow.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from tokenserve.errors import QueueFullError
from tokenserve.lifecycle.server_protos import BatchingParameters


@dataclass
class _Call:
    inputs: dict[str, np.ndarray]
    num_rows: int
    deadline: float | None = None
    """time.monotonic() by which the caller needs its answer (None: no deadline)."""
    future: Future = field(default_factory=Future)
    enqueued_at: float = field(default_factory=time.monotonic)


class BatchingServable:
    """Wraps a servable with TF Serving's batching parameters.

    Args:
        servable: what runs the batches.
        params: max_batch_size, batch_timeout_micros (how long the oldest call waits for
            company), num_batch_threads, allowed_batch_sizes (batches are padded up to one
            of them by repeating the last row).
    """

    def __init__(self, servable, params: BatchingParameters):
        self._servable = servable
        self._params = params
        self.path = servable.path
        self.signature_defs = servable.signature_defs
        self._cond = threading.Condition()
        self._queues: dict[tuple, list[_Call]] = {}
        self._closed = False
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"batch-{index}")
                         for index in range(max(1, params.num_batch_threads))]
        for thread in self._threads:
            thread.start()

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None,
            timeout_s: float | None = None) -> dict[str, np.ndarray]:
        num_rows = _batch_rows(inputs)
        if num_rows is None or num_rows > self._params.max_batch_size or self._closed:
            return self._servable.run(signature_name, inputs, output_keys, timeout_s)
        key = (signature_name, tuple(sorted(output_keys or ())),
               tuple((name, value.dtype.str, value.shape[1:])
                     for name, value in sorted(inputs.items())))
        call = _Call(inputs, num_rows,
                     None if timeout_s is None else time.monotonic() + timeout_s)
        with self._cond:
            queue = self._queues.setdefault(key, [])
            # max_enqueued_batches full batches may wait per queue, as in TF Serving; past
            # that a call is refused at once instead of queueing without bound.
            limit = self._params.max_enqueued_batches * self._params.max_batch_size
            if sum(queued.num_rows for queued in queue) + num_rows > limit:
                if not queue:
                    del self._queues[key]
                raise QueueFullError("The batch scheduling queue to which this task was "
                                     "submitted is full")
            queue.append(call)
            self._cond.notify_all()
        return call.future.result()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(5)
        self._servable.close()

    # ---- batch threads -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
            key, calls = batch
            self._run_batch(key, calls)

    def _next_batch(self):
        """Waits (holding the condition) until a batch is due; None when closed and empty."""
        timeout_s = self._params.batch_timeout_micros / 1e6
        while True:
            ready = [(calls[0].enqueued_at, key) for key, calls in self._queues.items() if calls]
            if not ready:
                if self._closed:
                    return None
                self._cond.wait()
                continue
            oldest_at, key = min(ready)
            calls = self._queues[key]
            rows = sum(call.num_rows for call in calls)
            wait_s = oldest_at + timeout_s - time.monotonic()
            if rows >= self._params.max_batch_size or wait_s <= 0 or self._closed:
                taken, total = [], 0
                while calls and total + calls[0].num_rows <= self._params.max_batch_size:
                    total += calls[0].num_rows
                    taken.append(calls.pop(0))
                if not calls:  # keys hold input shapes, which clients choose: drop empty ones
                    del self._queues[key]
                return key, taken
            self._cond.wait(wait_s)

    def _run_batch(self, key: tuple, calls: list[_Call]) -> None:
        signature_name, output_keys = key[0], list(key[1]) or None
        if len(calls) == 1:
            self._run_alone(signature_name, calls[0], output_keys)
            return
        total = sum(call.num_rows for call in calls)
        padded = self._padded_size(total)
        inputs = {}
        for name in calls[0].inputs:
            joined = np.concatenate([call.inputs[name] for call in calls])
            if padded > total:
                joined = np.concatenate([joined, np.repeat(joined[-1:], padded - total, 0)])
            inputs[name] = joined
        # The batch may run as long as its most patient caller waits.
        deadlines = [call.deadline for call in calls]
        timeout_s = None if None in deadlines else max(deadlines) - time.monotonic()
        try:
            outputs = self._servable.run(signature_name, inputs, output_keys, timeout_s)
            if any(np.ndim(v) == 0 or len(v) != padded for v in outputs.values()):
                raise ValueError("outputs are not batched along dimension 0")
        except Exception:  # noqa: BLE001 - retry each call alone; only bad ones fail
            for call in calls:
                self._run_alone(signature_name, call, output_keys)
            return
        start = 0
        for call in calls:
            end = start + call.num_rows
            call.future.set_result({name: value[start:end] for name, value in outputs.items()})
            start = end

    def _run_alone(self, signature_name: str, call: _Call, output_keys) -> None:
        timeout_s = None if call.deadline is None else call.deadline - time.monotonic()
        try:
            call.future.set_result(self._servable.run(signature_name, call.inputs, output_keys,
                                                      timeout_s))
        except Exception as error:  # noqa: BLE001 - delivered to the caller
            call.future.set_exception(error)

    def _padded_size(self, total: int) -> int:
        allowed = [size for size in self._params.allowed_batch_sizes if size >= total]
        return min(allowed) if allowed else total


def _batch_rows(inputs: dict[str, np.ndarray]) -> int | None:
    """The common first dimension of all inputs, or None when they have none."""
    sizes = {np.shape(value)[0] if np.ndim(value) else None for value in inputs.values()}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    return size if size else None
