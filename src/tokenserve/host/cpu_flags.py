"""The CPU's feature flags: what the kernel builds key their cache on, what picks a prebuilt
kernel variant, and what the precision choices (bf16 matmuls, AVX-512 in XLA) read."""

from __future__ import annotations

import platform

CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str = CPUINFO) -> str:
    """The CPU's feature flags (Linux: `cpuinfo`'s first `flags` or `Features` line), space
    separated; elsewhere the machine and processor names, so a cached build is never reused
    on another CPU.

    Args:
        cpuinfo: the file to read (another path plants a CPU in tests).
    """
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cpu_flag_set(cpuinfo: str = CPUINFO) -> frozenset[str]:
    """cpu_flags as a set of names, as /proc/cpuinfo spells them ("avx2", "avx512_vnni")."""
    return frozenset(cpu_flags(cpuinfo).split())
