"""Building and loading tokenserve's custom TensorFlow ops (shared by every op module).

The ops are C++ files next to this one, one op (or family of ops) a file, grouped into
libraries (`LIBRARIES`: one per op module, e.g. `dense` = dense.cc, row_ops.cc,
finish_block.cc, split_rope.cc) with the headers beside them (`op_support.h` holds what
every op file repeats; `helpers.cc` is the libraries' shared runtime). A library is compiled
on first use with the local g++ and TensorFlow's own compile flags into
`tokenserve.host.user_cache.cache_dir("kernels")` as `<name>-<hash>.so`. The hash covers
every source and header, the TF version, the compile and link flags and the CPU's feature
flags, so a cached build is never reused for other code, TF or CPU. A build writes a
temporary file and renames it into place (atomic), so concurrent builders and loaders are
safe. A library is loaded once per process (by .so path); each library remembers its own
outcome (the module, or why it is unavailable) and its op module falls back to pure TF when
it has none.

This module imports no op module: each op module takes its entry of `LIBRARIES`.

Environment:
  TOKENSERVE_KERNELS=fallback       every op takes its pure-TF fallback
  TOKENSERVE_KERNELS_MARCH=...      build target of every op: "native" (default), "avx2"
                                    (-mavx2 -mfma: what a generic AVX2 machine runs, to
                                    benchmark that on an AVX-512 one) or any -march value
  per library (read first): its mode_env (=fallback) and march_env in `LIBRARIES`, e.g.
                        TOKENSERVE_INT8_KERNEL=fallback, TOKENSERVE_INT8_KERNEL_MARCH=...
  TOKENSERVE_KERNEL_SPIN_US=2000    how long the ops' helper threads keep polling for work
                                    after their last chunk before they sleep (chunks.h);
                                    0: no helper team, ops wake TF's pool threads instead

`python -m tokenserve.kernels.build` builds every op and prints each one's status.
"""

from __future__ import annotations

import ctypes
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

KERNELS_ENV = "TOKENSERVE_KERNELS"
MARCH_ENV = "TOKENSERVE_KERNELS_MARCH"
KERNELS_DIR = Path(__file__).parent

_lock = threading.Lock()
_libraries: dict[Path, object] = {}  # .so path -> the module tf.load_op_library returned


def forced_fallback(*mode_envs: str) -> str | None:
    """The variable (of `mode_envs`, then TOKENSERVE_KERNELS) that is set to "fallback", or
    None. Read on every call: a graph traced later sees a changed setting."""
    for name in (*mode_envs, KERNELS_ENV):
        if os.environ.get(name, "").strip().lower() == "fallback":
            return name
    return None


def arch_flags(*march_envs: str) -> list[str]:
    """The -m flags from the first of `march_envs`, TOKENSERVE_KERNELS_MARCH that is set
    (default: -march=native)."""
    march = next((os.environ[name].strip() for name in (*march_envs, MARCH_ENV)
                  if os.environ.get(name, "").strip()), "native")
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


def compile_flags(arch: list[str]) -> list[str]:
    """g++'s flags for a library built for `arch` (TF's own, so the ops match its ABI)."""
    return ["-O3", *arch, "-std=c++17", "-shared", "-fPIC", *tf.sysconfig.get_compile_flags()]


def library_path(name: str, sources: Sequence[Path], arch: list[str]) -> Path:
    """Where library `name` built from `sources` for `arch` is cached: `<name>-<hash>.so`, the
    hash of every source and of every header beside them (any of which they may include:
    chunks.h, op_support.h, ...), TF's version, the flags and the CPU's feature flags."""
    headers = sorted({header for source in sources for header in Path(source).parent.glob("*.h")})
    code = b"\0".join(path.name.encode() + b"\0" + path.read_bytes()
                      for path in [*map(Path, sources), *headers])
    flags = compile_flags(arch) + tf.sysconfig.get_link_flags()
    key = hashlib.sha256(b"\0".join([code, tf.__version__.encode(), " ".join(flags).encode(),
                                     cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir("kernels") / f"{name}-{key}.so"


def build_library(name: str, sources: Sequence[Path], arch: list[str]) -> Path:
    """Compiles `sources` into library `name` (if not cached) and returns the .so path.

    Raises RuntimeError when it is not cached and g++ is missing or the build fails (the
    message names the library and quotes the first error line); no file is left behind then.
    """
    target = library_path(name, sources, arch)
    if target.exists():  # built before (needs no compiler now)
        return target
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("g++ not found")
    out_dir = target.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    command = [compiler, *compile_flags(arch)]
    try:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}-") as work:
            # each source is its own translation unit: compiled side by side, then linked
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
    """One g++ step of building library `name`; RuntimeError quoting its first error line."""
    log.info("building %s: %s", name, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        raise RuntimeError(f"compiling {name} failed: "
                           f"{(errors or result.stderr.splitlines() or ['?'])[0]}")


RUNTIME_SOURCE = KERNELS_DIR / "helpers.cc"
_runtime: list[object] = []  # the runtime library once loaded (or the reason it is not)


def load_runtime(arch: list[str]) -> None:
    """Builds (if needed) and loads the op libraries' runtime (`helpers.cc`: the process's
    one helper team) with its symbols global, once per process, before any op library: each
    op library then finds it instead of starting a team of its own. On failure the op
    libraries still work, each with its own team."""
    with _lock:
        if _runtime:
            return
        try:
            _runtime.append(ctypes.CDLL(str(build_library("helpers", [RUNTIME_SOURCE], arch)),
                                        mode=os.RTLD_NOW | os.RTLD_GLOBAL))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("kernel runtime unavailable, each op library keeps its own helper "
                        "threads: %s", str(e).strip().splitlines()[0] if str(e).strip()
                        else type(e).__name__)
            _runtime.append(str(e))


def load_library(name: str, sources: Sequence[Path], arch: list[str],
                 what: str) -> tuple[object, str] | str:
    """Builds (if needed) and loads library `name`: (op module, build flags), or the reason it
    is unavailable (str; logged as a warning naming `what`). Callers keep the outcome (one
    build attempt per process); the same .so is only passed to tf.load_op_library once."""
    try:
        load_runtime(arch)
        path = build_library(name, sources, arch)
        with _lock:
            if path not in _libraries:
                _libraries[path] = tf.load_op_library(str(path))
            return _libraries[path], " ".join(arch)
    except (OSError, RuntimeError, subprocess.SubprocessError, tf.errors.OpError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("%s unavailable, using the pure-TF fallback: %s", what, reason)
        return reason


class OpLibrary:
    """One op library: its sources, the variables that force its fallback and pick its build
    target, the op that names the instruction set its kernels take, and its build-and-load
    outcome, kept once per process.

    Args:
        name: the library's name (its .so's, and its op module's).
        sources: its .cc files, one op or family of ops each (names in KERNELS_DIR).
        what: what the library is, in messages ("dense op").
        mode_env: set to "fallback", its ops take their pure-TF fallback.
        info_op: its op that reports the instruction set of its kernels here.
        march_env: its build target, read before TOKENSERVE_KERNELS_MARCH (None: none).
        detail: added after that instruction set in `status` (what its kernels do).

    Example:
        >>> LIBRARY = LIBRARIES["dense"]
        >>> op = LIBRARY.module()   # None: take the pure-TF fallback
        >>> LIBRARY.status()
        'compiled dense op (AVX2+FMA; built with -march=native)'
    """

    def __init__(self, name: str, sources: Sequence[str], what: str, mode_env: str,
                 info_op: str, march_env: str | None = None, detail: str = ""):
        self.name, self.what = name, what
        self.sources = tuple(KERNELS_DIR / source for source in sources)
        self.mode_env, self.march_env = mode_env, march_env
        self.info_op, self.detail = info_op, detail
        self._lock = threading.Lock()
        # (module, build flags) once loaded, or why it is unavailable (str)
        self._loaded: tuple[object, str] | str | None = None

    def forced_fallback(self) -> str | None:
        return forced_fallback(self.mode_env)

    def load(self) -> tuple[object, str] | str:
        """Builds (if needed) and loads the library once: (module, flags) or the reason."""
        with self._lock:
            if self._loaded is None:
                march = (self.march_env,) if self.march_env else ()
                self._loaded = load_library(self.name, self.sources, arch_flags(*march),
                                            self.what)
            return self._loaded

    def module(self):
        """The op module, or None when the pure-TF fallback is to be used (forced or
        unavailable). Read when a graph is traced."""
        if self.forced_fallback():
            return None
        loaded = self.load()
        return None if isinstance(loaded, str) else loaded[0]

    def is_compiled(self) -> bool:
        """True when the compiled op is loaded and not forced off (builds it if needed)."""
        return self.module() is not None

    def status(self) -> str:
        """One line: which path the ops take here, and why (builds them if needed)."""
        forced = self.forced_fallback()
        if forced:
            return f"pure-TF fallback: {forced}=fallback"
        loaded = self.load()
        if isinstance(loaded, str):
            return f"pure-TF fallback: {loaded}"
        op, flags = loaded
        isa = getattr(op, self.info_op)().numpy().decode()
        return f"compiled {self.what} ({isa}{self.detail}; built with {flags})"

    def reset(self) -> None:
        """Forgets the outcome, as a fresh process would (tests)."""
        with self._lock:
            self._loaded = None


INT8_ACTIVATIONS = ", int8 activations per 32-block"

# Every op library, by name: each op module takes its own (`LIBRARIES["dense"]`), and
# `main` builds them all.
LIBRARIES = {library.name: library for library in (
    OpLibrary("int8_matmul", ["int8_matmul.cc", "int8_finish_block.cc"], "int8 matmul op",
              mode_env="TOKENSERVE_INT8_KERNEL", info_op="tokenserve_int8_matmul_info",
              march_env="TOKENSERVE_INT8_KERNEL_MARCH", detail=INT8_ACTIVATIONS),
    OpLibrary("paged_attention", ["paged_attention.cc"], "paged attention op",
              mode_env="TOKENSERVE_PAGED_ATTENTION_KERNEL",
              info_op="tokenserve_paged_decode_attention_info"),
    OpLibrary("dense", ["dense.cc", "row_ops.cc", "finish_block.cc", "lora_finish_block.cc",
                         "split_rope.cc"],
              "dense op", mode_env="TOKENSERVE_DENSE_KERNEL", info_op="tokenserve_dense_info"),
    OpLibrary("head_screen", ["head_screen.cc", "screened_logits.cc"], "head screen op",
              mode_env="TOKENSERVE_HALF_KERNEL", info_op="tokenserve_half_matmul_info"),
    OpLibrary("gguf_matmul", ["gguf_matmul.cc"], "GGUF block matmul op",
              mode_env="TOKENSERVE_GGUF_KERNEL", info_op="tokenserve_gguf_matmul_info",
              march_env="TOKENSERVE_GGUF_KERNEL_MARCH", detail=INT8_ACTIVATIONS),
    OpLibrary("moe", ["moe_experts.cc", "moe_layer.cc"], "mixture-of-experts op",
              mode_env="TOKENSERVE_MOE_KERNEL", info_op="tokenserve_moe_info"),
)}


def main() -> int:
    """Builds every op library; prints one status line each. Exit status 1 if any is
    unavailable (forced fallbacks count as fine)."""
    ok = True
    for name, library in LIBRARIES.items():
        status = library.status()
        print(f"{name}: {status}")
        ok = ok and (status.startswith("compiled") or "=fallback" in status)
    return 0 if ok else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(main())
