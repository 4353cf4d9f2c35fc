#!/usr/bin/env python
"""How fast this machine reads memory: the ceiling for one float32 decode stream.

A batch-1 decode step reads every weight once (GPT-2-small in float32: 498 MB a token), so
tokens per second can be no higher than the read rate over those bytes. This sums 256 MiB
float32 arrays (far larger than any cache) with numpy, on one thread and on one thread per
core at once (numpy's sum releases the GIL), and reports the medians of `--reps`.

Memory bandwidth on these shared VMs moves from hour to hour, so compare it with a
benchmark's figures from the same hour (benchmarks/headline.py records its result here too).

    python benchmarks/read_bandwidth.py [--reps 7] [--output benchmarks/results/read-bandwidth.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from common import RESULTS, machine_info, machine_summary, write_result

ARRAY_BYTES = 256 * 1024 * 1024


def _sum_timed(array: np.ndarray, seconds: list[float], slot: int) -> None:
    started = time.perf_counter()
    array.sum()
    seconds[slot] = time.perf_counter() - started


def read_bandwidth(reps: int = 7, threads: int | None = None) -> dict:
    """{"one_thread_gb_s", "all_threads_gb_s", "threads"}: medians over `reps` rounds."""
    threads = threads or len(os.sched_getaffinity(0))
    arrays = [np.ones(ARRAY_BYTES // 4, np.float32) for _ in range(threads)]
    one, many = [], []
    for _ in range(reps):
        seconds = [0.0] * threads
        workers = [threading.Thread(target=_sum_timed, args=(a, seconds, i))
                   for i, a in enumerate(arrays)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        many.append(threads * ARRAY_BYTES / (time.perf_counter() - started) / 1e9)
        _sum_timed(arrays[0], seconds, 0)
        one.append(ARRAY_BYTES / seconds[0] / 1e9)
    return {"one_thread_gb_s": statistics.median(one),
            "all_threads_gb_s": statistics.median(many), "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--output", type=Path, default=RESULTS / "read-bandwidth.json")
    args = parser.parse_args()
    machine = machine_info()
    print(machine_summary(machine))
    result = read_bandwidth(args.reps)
    print(f"read bandwidth, median of {args.reps}: one thread {result['one_thread_gb_s']:.1f} "
          f"GB/s, {result['threads']} threads {result['all_threads_gb_s']:.1f} GB/s")
    write_result(args.output, **result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
