"""Compiling an op library: g++'s flags, the cache key of a build, and the build itself.

A library is its .cc files, each its own translation unit (compiled side by side, then
linked), with TensorFlow's own compile and link flags so the ops match its ABI. A build
writes a temporary file and renames it into place (atomic), so concurrent builders and
loaders are safe, and leaves nothing behind when it fails.

A build for this CPU (`library_path`: -march=native or TOKENSERVE_KERNELS_MARCH) is keyed on
the CPU's flags too, so it is never reused on another CPU; a prebuilt variant
(`prebuilt.py`) is keyed without them, since its -march says what it needs.

Environment (read when a library loads):
  TOKENSERVE_KERNELS_MARCH=...   build target of every op: "avx2" (-mavx2 -mfma: what a
                                 generic AVX2 machine runs, to benchmark that on an AVX-512
                                 one) or any -march value; set, it is built rather than a
                                 prebuilt variant taken. Unset: a prebuilt variant, else
                                 -march=native.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import tensorflow as tf

from tokenserve.host.cpu_flags import cpu_flags
from tokenserve.host.user_cache import cache_dir

log = logging.getLogger("tokenserve.kernels")

MARCH_ENV = "TOKENSERVE_KERNELS_MARCH"
# At most one g++ process per CPU in this process: building every variant at once starts many
# builds, and each g++ over TF's headers takes hundreds of MB.
_compiles = threading.BoundedSemaphore(os.cpu_count() or 1)


class KernelBuildError(RuntimeError):
    """An op library could not be built or found; the message says which and why."""


class CompilerNotFoundError(KernelBuildError):
    """A library had to be compiled and there is no g++."""


def explicit_march(*march_envs: str) -> str | None:
    """The build target from the first of `march_envs`, TOKENSERVE_KERNELS_MARCH that is set,
    or None (then a prebuilt variant or -march=native)."""
    return next((os.environ[name].strip() for name in (*march_envs, MARCH_ENV)
                 if os.environ.get(name, "").strip()), None)


def arch_flags(*march_envs: str) -> list[str]:
    """The -m flags from the first of `march_envs`, TOKENSERVE_KERNELS_MARCH that is set
    (default: -march=native)."""
    march = explicit_march(*march_envs) or "native"
    if march == "avx2":
        return ["-mavx2", "-mfma"]
    # TF's bundled Eigen has AVX512-FP16 packet code (Eigen/src/Core/arch/AVX512/
    # PacketMathFP16.h) that g++ 12 rejects ("expected initializer before '<'"), so on a CPU
    # with avx512_fp16 (Sapphire Rapids and later) -march=native failed every build and every
    # op fell back to pure TF. No op computes in half precision: turn the extension off. The
    # g++ probe is only needed where the target can include it (an explicit -march, or a CPU
    # that has it), so other CPUs start no compiler process for it.
    if march == "native" and "avx512_fp16" not in cpu_flags().split():
        return ["-march=native"]
    return [f"-march={march}", *_no_avx512fp16()]


@cache
def _no_avx512fp16() -> tuple[str, ...]:
    """("-mno-avx512fp16",) when g++ knows the flag (g++ 12 and later), else ()."""
    compiler = shutil.which("g++")
    if compiler is None:
        return ()
    try:
        probe = subprocess.run([compiler, "-mno-avx512fp16", "-E", "-x", "c++", os.devnull],
                               capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ()
    return ("-mno-avx512fp16",) if probe.returncode == 0 else ()


def compile_flags(arch: Sequence[str]) -> list[str]:
    """g++'s flags for a library built for `arch` (TF's own, so the ops match its ABI)."""
    return ["-O3", *arch, "-std=c++17", "-shared", "-fPIC", *tf.sysconfig.get_compile_flags()]


def library_key(sources: Sequence[Path], flags: Sequence[str], cpu: str = "") -> str:
    """16 hex digits of the hash of every source and of every header beside them (any of
    which they may include: chunks.h, op_support.h, ...), TF's version, `flags` and `cpu`."""
    headers = sorted({header for source in sources for header in Path(source).parent.glob("*.h")})
    code = b"\0".join(path.name.encode() + b"\0" + path.read_bytes()
                      for path in [*map(Path, sources), *headers])
    return hashlib.sha256(b"\0".join([code, tf.__version__.encode(), " ".join(flags).encode(),
                                      cpu.encode()])).hexdigest()[:16]


def library_path(name: str, sources: Sequence[Path], arch: Sequence[str]) -> Path:
    """Where library `name` built from `sources` for `arch` on this CPU is cached:
    `<user cache>/kernels/<name>-<key>.so`, keyed on the flags and the CPU's feature flags."""
    flags = compile_flags(arch) + tf.sysconfig.get_link_flags()
    return cache_dir("kernels") / f"{name}-{library_key(sources, flags, cpu_flags())}.so"


def build_library(name: str, sources: Sequence[Path], arch: Sequence[str],
                  target: Path | None = None) -> Path:
    """Compiles `sources` into library `name` at `target` (default `library_path`) unless it
    is there already, and returns that path.

    Raises:
        CompilerNotFoundError: it is not there and there is no g++.
        KernelBuildError: the build failed (the message names the library and quotes the
            first error line); no file is left behind then.
    """
    target = target or library_path(name, sources, arch)
    if target.exists():  # built before (needs no compiler now)
        return target
    compiler = shutil.which("g++")
    if compiler is None:
        raise CompilerNotFoundError("g++ not found")
    out_dir = target.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    command = [compiler, *compile_flags(arch)]
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}-") as work:
            objects = [os.path.join(work, f"{i}.o") for i in range(len(sources))]
            jobs = [[*command, "-c", str(source), "-o", obj]
                    for source, obj in zip(sources, objects)]
            with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
                for _ in pool.map(lambda job: _run(name, job), jobs):
                    pass
            _run(name, [*command, *objects, "-o", tmp, *tf.sysconfig.get_link_flags()])
        os.chmod(tmp, 0o755)  # mkstemp made it private; a shared cache needs it readable
        os.replace(tmp, target)  # atomic: a concurrent loader sees all of it or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _run(name: str, command: list[str]) -> None:
    """One g++ step of building library `name`; KernelBuildError quoting its first error."""
    log.info("building %s: %s", name, " ".join(command))
    try:
        with _compiles:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        raise KernelBuildError(f"compiling {name} took over {e.timeout:.0f} s") from e
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        raise KernelBuildError(f"compiling {name} failed: "
                               f"{(errors or result.stderr.splitlines() or ['?'])[0]}")
