"""The CPU's feature flags: what the kernel builds key their cache on and what the precision
choices (bf16 matmuls, AVX-512 in XLA) read."""

from __future__ import annotations

import platform


def cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo's `flags` or `Features` line), space
    separated; elsewhere the machine and processor names, so a cached build is never reused
    on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"
