"""How many CPUs this process may really use, and TensorFlow's thread pools sized to that.

TensorFlow sizes its intra- and inter-op pools to the CPUs the process may be scheduled on
(`sched_getaffinity`), not to the CPU time its container is given. A container limited to 2
CPUs on a 32-core host (`docker run --cpus=2`, a Kubernetes CPU limit) gets 32-thread
pools, every parallel op is cut into 32 pieces, and the kernels' helper team (one thread
fewer than the intra-op pool, polling between ops) has 31 threads: all of them draw on a
quota of 2 CPUs, and the process is throttled for most of each period. On a 2-core Xeon in
a cgroup with a 1-CPU quota, GPT-2-small int8 made 80 tok/s with TF's two default threads
and 105 with one.

So when the process's cgroups (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
`cpu.cfs_period_us`, the process's cgroup and each one above it) allow fewer CPUs than the
affinity mask, `size_tensorflow_threads` sets `TF_NUM_INTRAOP_THREADS` and
`TF_NUM_INTEROP_THREADS`, which TF reads when it creates its first context. The quota is
rounded down (at least 1), as Go's automaxprocs does: a thread more than the quota pays for
is a thread the scheduler throttles. Settings a user made (those variables, or
`--tensorflow_intra_op_parallelism`) win.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# what size_tensorflow_threads did in this process, for the engine's start-up log
_APPLIED: list["CpuQuota"] = []


@dataclass(frozen=True)
class CpuQuota:
    """The tightest CPU quota over the process's cgroups."""
    cpus: float  # CPUs' worth of time per period
    cgroup: str  # the directory whose limit it is

    @property
    def threads(self) -> int:
        return max(1, math.floor(self.cpus))


def cpu_quota(proc: Path = Path("/proc/self")) -> CpuQuota | None:
    """The tightest CPU quota of this process's cgroups, or None when there is none (or no
    cgroup file system to read)."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for mount_root, mount_point, version in _cpu_mounts(mounts):
        path = _cgroup_path(memberships, version)
        if path is None:
            continue
        # a path outside the mounted subtree (another namespace's view) is read from the
        # mount's top, as the container's own cgroup
        relative = os.path.relpath(path, mount_root) if _is_under(path, mount_root) else "."
        directory = Path(mount_point) / relative
        while True:
            cpus = _read_quota(directory, version)
            if cpus is not None:
                quotas.append(CpuQuota(cpus, str(directory)))
            if directory == Path(mount_point) or directory.parent == directory:
                break
            directory = directory.parent
    return min(quotas, key=lambda q: q.cpus, default=None)


def schedulable_cpus() -> int:
    """The CPUs in this process's affinity mask (what TF sizes its pools by)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def usable_cpus(proc: Path = Path("/proc/self")) -> int:
    """How many threads this process can keep running at once: the affinity mask's CPUs,
    fewer when a cgroup's CPU quota allows fewer."""
    cores = schedulable_cpus()
    quota = cpu_quota(proc)
    return cores if quota is None else min(cores, quota.threads)


def size_tensorflow_threads(proc: Path = Path("/proc/self")) -> CpuQuota | None:
    """Sizes TensorFlow's thread pools to the CPU quota when it allows fewer CPUs than the
    affinity mask and the user set neither pool; the quota it applied, else None.

    Call it before TensorFlow creates its first context (the first op or model load);
    after that TF keeps the pools it has."""
    if {"TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"} & os.environ.keys():
        return None
    quota = cpu_quota(proc)
    if quota is None or quota.threads >= schedulable_cpus():
        return None
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(quota.threads)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(quota.threads)
    _APPLIED[:] = [quota]
    return quota


def applied_quota() -> CpuQuota | None:
    """The quota size_tensorflow_threads applied in this process, if any."""
    return _APPLIED[0] if _APPLIED else None


def _cpu_mounts(mountinfo: list[str]) -> list[tuple[str, str, int]]:
    """(root inside the hierarchy, mount point, cgroup version) of the mounts that carry the
    cpu controller: every cgroup2 mount, and v1 mounts with `cpu` among their options."""
    found = []
    for line in mountinfo:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        if rest[0] == "cgroup2":
            found.append((root, mount_point, 2))
        elif rest[0] == "cgroup" and "cpu" in rest[2].split(","):
            found.append((root, mount_point, 1))
    return found


def _cgroup_path(memberships: list[str], version: int) -> str | None:
    """The process's cgroup in the v2 hierarchy, or in the v1 hierarchy with `cpu`."""
    for line in memberships:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if version == 2 and parts[0] == "0" and controllers == "":
            return path
        if version == 1 and "cpu" in controllers.split(","):
            return path
    return None


def _read_quota(directory: Path, version: int) -> float | None:
    """CPUs' worth of time per period that one cgroup allows; None without a limit."""
    try:
        if version == 2:
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or "100000")
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        if quota <= 0:  # -1: unlimited
            return None
        return quota / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _is_under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, char)
    return field
