"""The ops' helper team (kernels/chunks.h, helpers.cc): one team per process, shared by every
op library, that sleeps when the ops stop, and that changes no op's output.

Each check runs in a fresh Python process: the team is created once per process, with the
TOKENSERVE_KERNEL_SPIN_US it finds then, and its threads live as long as the process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")

# Runs the int8 op and the dense op (two op libraries) on shapes big enough to be split
# into chunks, then reports the helper threads (name and state) while the ops still run,
# 0.3 s after the last op, and the outputs.
SCRIPT = textwrap.dedent("""
    import glob, json, os, sys, time
    import numpy as np
    import tensorflow as tf
    from tokenserve.kernels import dense, int8_matmul

    def helpers():
        found = []
        for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
            try:
                name = open(f"{task}/comm").read().strip()
                state = open(f"{task}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if name == "tokenserve-help":
                found.append(state)
        return found

    assert int8_matmul.LIBRARY.is_compiled() and dense.LIBRARY.is_compiled()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1024, 4096)).astype(np.float32)
    q, s = int8_matmul.quantize_weight(w)
    x = tf.constant(rng.standard_normal((4, 1024)).astype(np.float32))
    q, s, w = tf.constant(q), tf.constant(s), tf.constant(w)
    outs = []
    for _ in range(20):
        outs = [int8_matmul.int8_matmul(x, q, s).numpy(), dense.dense(x, w).numpy()]
    busy = helpers()
    time.sleep(0.3)
    idle = helpers()
    json.dump({"busy": busy, "idle": idle, "threads": tf.config.threading.get_intra_op_parallelism_threads(),
               "int8": outs[0].tolist(), "dense": outs[1].tolist()}, sys.stdout)
""")


def run(spin_us: str | None, threads: int = 2) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": str(threads)}
    env.pop("TOKENSERVE_KERNEL_SPIN_US", None)
    if spin_us is not None:
        env["TOKENSERVE_KERNEL_SPIN_US"] = spin_us
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_one_team_for_every_op_library_and_it_sleeps_when_the_ops_stop():
    report = run(None)
    # two intra-op threads: one helper beside the calling thread, shared by the int8 and the
    # dense library (a team per library would show two)
    assert len(report["busy"]) == 1, report["busy"]
    # 0.3 s after the last op, past the default 2 ms of polling, it sleeps: no core is burnt
    # by an idle server
    assert report["idle"] == ["S"], report["idle"]


def test_spin_zero_turns_the_team_off_and_the_outputs_do_not_change():
    on, off = run("5000"), run("0")
    assert off["busy"] == [] and off["idle"] == []
    assert len(on["busy"]) == 1
    # the int8 op's chunks are whole output tiles, summed in one fixed order whoever runs
    # them: the same bits with or without the team
    assert on["int8"] == off["int8"]
    # the dense op at 4 rows splits K between threads and adds the partial sums in the
    # order the threads finish, so only float rounding may differ
    np.testing.assert_allclose(on["dense"], off["dense"], rtol=1e-5, atol=1e-4)


def test_one_intra_op_thread_starts_no_helper():
    report = run(None, threads=1)
    assert report["busy"] == [] and report["idle"] == []
