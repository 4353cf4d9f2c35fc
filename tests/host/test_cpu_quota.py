"""TensorFlow's thread pools sized to a container's CPU quota (tokenserve/host/cpu_quota.py).

The parsing is checked on cgroup trees written here (v1 and v2, nested limits, containers
whose cgroup path is outside the mounted subtree); the whole effect in a real cgroup with
a 1-CPU quota, where the machine lets this process make one (root, a writable cpu
controller): a fresh `import tokenserve` sizes TF's intra-op pool to 1, so the kernels'
helper team (one thread fewer than that pool) starts no thread, and a user's own
TF_NUM_INTRAOP_THREADS still wins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tokenserve.host import cpu_quota
from tokenserve.host.cpu_quota import CpuQuota

V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
             "32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
             "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
V2_MOUNT = "30 23 0:27 {root} {point} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n"


def fake_proc(tmp_path: Path, mountinfo: str, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "cgroup").write_text(cgroup)
    return proc


def write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (line.split("=", 1) for line in text.split(";")):
        (path / name).write_text(value + "\n")


def test_v2_takes_the_tightest_limit_of_the_cgroup_and_those_above_it(tmp_path):
    point = tmp_path / "cg2"
    write(point / "kubepods/pod1", "cpu.max=250000 100000")
    write(point / "kubepods/pod1/ctr", "cpu.max=max 100000")
    write(point / "kubepods", "cpu.max=max 100000")
    proc = fake_proc(tmp_path, V2_MOUNT.format(root="/", point=point),
                     "0::/kubepods/pod1/ctr\n")
    quota = cpu_quota.cpu_quota(proc)
    assert quota == CpuQuota(2.5, str(point / "kubepods/pod1"))
    assert quota.threads == 2  # rounded down: a third thread would be throttled

    write(point / "kubepods/pod1/ctr", "cpu.max=50000 100000")  # half a CPU: still one
    quota = cpu_quota.cpu_quota(proc)
    assert quota.cpus == 0.5 and quota.threads == 1


def test_v1_in_a_container_whose_path_is_the_mounts_root(tmp_path):
    # Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host's
    # path, and the container sees that cgroup mounted as the top of /sys/fs/cgroup/cpu
    point = tmp_path / "cpu,cpuacct"
    write(point, "cpu.cfs_quota_us=150000;cpu.cfs_period_us=100000")
    proc = fake_proc(tmp_path, V1_MOUNTS.format(root="/docker/abc", point=point),
                     "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_quota.cpu_quota(proc) == CpuQuota(1.5, str(point))


def test_v1_cgroup_path_outside_the_mount_is_read_from_the_mounts_top(tmp_path):
    point = tmp_path / "cpu"
    write(point, "cpu.cfs_quota_us=300000;cpu.cfs_period_us=100000")
    proc = fake_proc(tmp_path, V1_MOUNTS.format(root="/other", point=point),
                     "3:cpu,cpuacct:/docker/abc\n")
    assert cpu_quota.cpu_quota(proc).cpus == 3.0


def test_no_limit_no_cgroup_files_or_garbage_mean_no_quota(tmp_path):
    point = tmp_path / "cpu"
    write(point / "a", "cpu.cfs_quota_us=-1;cpu.cfs_period_us=100000")
    proc = fake_proc(tmp_path, V1_MOUNTS.format(root="/", point=point), "3:cpu,cpuacct:/a\n")
    assert cpu_quota.cpu_quota(proc) is None
    write(point / "a", "cpu.cfs_quota_us=lots;cpu.cfs_period_us=0")
    assert cpu_quota.cpu_quota(proc) is None
    assert cpu_quota.cpu_quota(tmp_path / "no-proc") is None
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "mountinfo").write_text("garbage\n1 2 3\n")
    (bare / "cgroup").write_text("not:a\n")
    assert cpu_quota.cpu_quota(bare) is None


def test_sizes_the_pools_only_when_the_quota_is_below_the_cores_and_the_user_set_nothing(
        tmp_path, monkeypatch):
    point = tmp_path / "cg2"
    write(point, "cpu.max=100000 100000")
    proc = fake_proc(tmp_path, V2_MOUNT.format(root="/", point=point), "0::/\n")
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        monkeypatch.delenv(name, raising=False)

    monkeypatch.setattr(cpu_quota, "schedulable_cpus", lambda: 1)  # nothing to gain
    assert cpu_quota.size_tensorflow_threads(proc) is None
    assert "TF_NUM_INTRAOP_THREADS" not in os.environ

    monkeypatch.setattr(cpu_quota, "schedulable_cpus", lambda: 8)
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "4")  # the user's choice wins
    assert cpu_quota.size_tensorflow_threads(proc) is None
    assert "TF_NUM_INTRAOP_THREADS" not in os.environ
    monkeypatch.delenv("TF_NUM_INTEROP_THREADS")

    monkeypatch.setattr(cpu_quota, "_APPLIED", [])
    assert cpu_quota.size_tensorflow_threads(proc) == CpuQuota(1.0, str(point))
    assert os.environ["TF_NUM_INTRAOP_THREADS"] == os.environ["TF_NUM_INTEROP_THREADS"] == "1"
    assert cpu_quota.applied_quota() == CpuQuota(1.0, str(point))
    assert cpu_quota.usable_cpus(proc) == 1


# In the quota'd cgroup: import tokenserve, run the int8 op (split into chunks), and report
# TF's thread variables and the helper threads while the op runs.
SCRIPT = textwrap.dedent("""
    import glob, json, os, sys
    import numpy as np
    import tokenserve
    import tensorflow as tf
    from tokenserve.kernels import int8_matmul

    assert int8_matmul.LIBRARY.is_compiled()
    rng = np.random.default_rng(0)
    q, s = int8_matmul.quantize_weight(rng.standard_normal((1024, 4096)).astype(np.float32))
    x = tf.constant(rng.standard_normal((4, 1024)).astype(np.float32))
    for _ in range(20):
        int8_matmul.int8_matmul(x, tf.constant(q), tf.constant(s)).numpy()
    names = []
    for task in glob.glob(f"/proc/{os.getpid()}/task/*/comm"):
        try:
            names.append(open(task).read().strip())
        except OSError:
            pass
    json.dump({"intra": os.environ.get("TF_NUM_INTRAOP_THREADS"),
               "helpers": names.count("tokenserve-help")}, sys.stdout)
""")


@pytest.fixture
def one_cpu_cgroup():
    """A cgroup (v1 cpu controller, or v2 with cpu enabled for children) with a 1-CPU quota,
    removed afterwards; skips where this process may not make one."""
    if cpu_quota.schedulable_cpus() < 2:
        pytest.skip("one CPU: a 1-CPU quota changes nothing")
    mounts = cpu_quota._cpu_mounts(Path("/proc/self/mountinfo").read_text().splitlines())
    for _, point, version in mounts:
        group = Path(point) / f"tokenserve-test-{uuid.uuid4().hex[:8]}"
        try:
            if version == 2 and "cpu" not in (Path(point) / "cgroup.subtree_control"
                                              ).read_text().split():
                continue
            group.mkdir()
        except OSError:
            continue
        try:
            if version == 2:
                (group / "cpu.max").write_text("100000 100000")
            else:
                (group / "cpu.cfs_period_us").write_text("100000")
                (group / "cpu.cfs_quota_us").write_text("100000")
        except OSError:
            group.rmdir()
            continue
        yield group
        group.rmdir()  # its processes have exited
        return
    pytest.skip("no cgroup with a cpu controller that this process may create")


def run_in(group: Path, env: dict[str, str]) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env}
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
                 "TOKENSERVE_KERNEL_SPIN_US"):
        if name not in env or env[name] == "":
            env.pop(name, None)
    procs = str(group / "cgroup.procs")
    result = subprocess.run(
        ["sh", "-c", f'echo $$ > "{procs}" && exec "$0" -c "$1"', sys.executable, SCRIPT],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_in_a_real_one_cpu_cgroup_the_pools_and_the_helper_team_shrink(one_cpu_cgroup):
    report = run_in(one_cpu_cgroup, {"TF_NUM_INTRAOP_THREADS": "", "TF_NUM_INTEROP_THREADS": ""})
    # one intra-op thread: the op's chunks run on the calling thread, and no helper polls
    assert report == {"intra": "1", "helpers": 0}
    # a user who asks for two threads gets them, and with them one helper
    report = run_in(one_cpu_cgroup, {"TF_NUM_INTRAOP_THREADS": "2"})
    assert report == {"intra": "2", "helpers": 1}
