"""What machine a benchmark ran on: CPU model, ISA flags, core count and the ISA-capping
environment, recorded in every result JSON and summarised in one line above each table.

Numbers from CPU benchmarks depend on which vector/matrix extensions the kernels may use
(AVX2, AVX-512, AVX512-BF16, AMX, AVX-VNNI) and on the variables that cap them for oneDNN
and XLA, so each result carries them:

    from machine import machine_info, machine_summary
    info = machine_info()            # dict for the JSON
    print(machine_summary(info))     # CPU: AMD EPYC, 2 cores, avx2 avx512f ... (ISA not capped)

Standard library only (the Hugging Face peer's virtualenv may import it too).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess

from tokenserve.cpu_quota import cpu_quota

# The ISA extensions that decide which oneDNN/XLA kernels run (bf16 and int8 paths included).
KEY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_vnni")
# Variables that cap or switch the CPU kernels; recorded when set.
ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS",
            "TF_XLA_FLAGS", "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
            "TF_NUM_INTEROP_THREADS", "TOKENSERVE_KERNELS_MARCH", "TOKENSERVE_KERNELS")


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def _cpuinfo() -> dict[str, str]:
    """Fallback when lscpu is missing: the first processor's entries in /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def machine_info() -> dict:
    """CPU model, flags (key ones as booleans plus the full string), core counts, platform
    and the ISA-related environment variables that are set."""
    lscpu = _lscpu()
    cpuinfo = {} if lscpu.get("Flags") and lscpu.get("Model name") else _cpuinfo()
    model = lscpu.get("Model name") or cpuinfo.get("model name")
    flags_str = lscpu.get("Flags") or cpuinfo.get("flags") or ""
    flags = set(flags_str.split())
    sockets = _int(lscpu.get("Socket(s)"))
    per_socket = _int(lscpu.get("Core(s) per socket"))
    cores = sockets * per_socket if sockets and per_socket else None
    return {
        "cpu_model": model,
        "cpu_vendor": lscpu.get("Vendor ID") or cpuinfo.get("vendor_id"),
        "cpu_count": os.cpu_count(),  # logical CPUs
        "cpu_cores": cores,  # physical cores (lscpu sockets x cores per socket)
        "threads_per_core": _int(lscpu.get("Thread(s) per core")),
        "cpu_affinity": (len(os.sched_getaffinity(0))
                         if hasattr(os, "sched_getaffinity") else None),
        # a cgroup CPU quota (a container's --cpus, a Kubernetes limit), in CPUs
        "cpu_quota": quota.cpus if (quota := cpu_quota()) is not None else None,
        "hypervisor": lscpu.get("Hypervisor vendor"),
        "isa": {flag: flag in flags for flag in KEY_FLAGS},
        "cpu_flags": flags_str,
        "env": {name: os.environ[name] for name in ENV_VARS if name in os.environ},
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def isa_caps(env: dict[str, str]) -> list[str]:
    """The settings in `env` that cap or switch off CPU kernels, as short strings."""
    caps = []
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if name in env:
            caps.append(f"{name}={env[name]}")
    for name in ("XLA_FLAGS", "TF_XLA_FLAGS"):
        caps += re.findall(r"--xla_cpu_max_isa=\S+", env.get(name, ""))
    if env.get("TF_ENABLE_ONEDNN_OPTS") is not None:
        caps.append(f"TF_ENABLE_ONEDNN_OPTS={env['TF_ENABLE_ONEDNN_OPTS']}")
    for name in ("TOKENSERVE_KERNELS_MARCH", "TOKENSERVE_KERNELS"):  # tokenserve's own ops
        if name in env:
            caps.append(f"{name}={env[name]}")
    return caps


def machine_summary(info: dict) -> str:
    """One line, e.g. `CPU: AMD EPYC, 2 cores, avx2 avx512f avx512_bf16 avx_vnni, no amx_bf16
    (ISA not capped)`."""
    cores = info.get("cpu_cores") or info.get("cpu_count")
    count = f"{cores} cores"
    if info.get("cpu_count") and cores and info["cpu_count"] != cores:
        count += f" / {info['cpu_count']} threads"
    if info.get("cpu_affinity") and info["cpu_affinity"] != info.get("cpu_count"):
        count += f" ({info['cpu_affinity']} usable)"
    isa = info.get("isa", {})
    have = [flag for flag in KEY_FLAGS if isa.get(flag)]
    lack = [flag for flag in KEY_FLAGS if not isa.get(flag)]
    flags = " ".join(have) or "none of " + " ".join(KEY_FLAGS)
    if have and lack:
        flags += ", no " + " ".join(lack)
    caps = isa_caps(info.get("env", {}))
    capped = f"ISA capped: {', '.join(caps)}" if caps else "ISA not capped"
    return f"CPU: {info.get('cpu_model') or 'unknown'}, {count}, {flags} ({capped})"


def write_result(path, **fields) -> dict:
    """Writes a benchmark's result JSON to `path`: the command that ran it, this machine
    (machine_info), the time it finished, then `fields`. Returns the machine info, for the
    summary line."""
    import json
    import sys
    import time
    from pathlib import Path

    info = machine_info()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": " ".join(sys.argv), "machine": info,
                                "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **fields},
                               indent=1) + "\n")
    return info


if __name__ == "__main__":
    import json

    info = machine_info()
    print(machine_summary(info))
    print(json.dumps({k: v for k, v in info.items() if k != "cpu_flags"}, indent=2))
