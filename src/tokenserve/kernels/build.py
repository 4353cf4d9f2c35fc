"""Building and loading tokenserve's custom TensorFlow ops (shared by every op module).

The ops are C++ files next to this one, one op (or family of ops) a file, grouped into
libraries (`LIBRARIES`: one per op module, e.g. `dense` = dense.cc, row_ops.cc,
finish_block.cc, split_rope.cc) with the headers beside them (`op_support.h` holds what
every op file repeats; `helpers.cc` is the libraries' shared runtime). A library loads from
a prebuilt ISA variant where one fits this CPU (`variants.py`, `prebuilt.py`), else it is
compiled on first use with the local g++ (`compiler.py`) into
`tokenserve.host.user_cache.cache_dir("kernels")`. A library is loaded once per process (by
.so path); each library remembers its own outcome (the module, or why it is unavailable) and
its op module falls back to pure TF when it has none.

This module imports no op module: each op module takes its entry of `LIBRARIES`.

Environment:
  TOKENSERVE_KERNELS=fallback       every op takes its pure-TF fallback
  TOKENSERVE_KERNELS_MARCH=...      build target of every op (compiler.py): "avx2" or any
                                    -march value, built instead of a prebuilt variant
  TOKENSERVE_KERNELS_ISA=...        the best prebuilt variant to take (variants.py)
  TOKENSERVE_KERNELS_DIR=/dir       searched first for prebuilt variants (prebuilt.py)
  per library (read first): its mode_env (=fallback) and march_env in `LIBRARIES`, e.g.
                        TOKENSERVE_INT8_KERNEL=fallback, TOKENSERVE_INT8_KERNEL_MARCH=...
  TOKENSERVE_KERNEL_SPIN_US=2000    how long the ops' helper threads keep polling for work
                                    after their last chunk before they sleep (chunks.h);
                                    0: no helper team, ops wake TF's pool threads instead

`python -m tokenserve.kernels.build` loads every op as serving would (building what it must)
and prints each one's status; `--all-variants` builds every library for every ISA variant of
this machine (`--help`).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import tensorflow as tf

from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.kernels import prebuilt
from tokenserve.kernels.all_variants import build_all_variants, format_builds
from tokenserve.kernels.compiler import (MARCH_ENV, arch_flags, build_library,  # noqa: F401
                                         compile_flags, library_path)
from tokenserve.kernels.prebuilt import Located
from tokenserve.kernels.variants import (VARIANTS, UnknownVariantError, choose_variant,
                                         isa_cap, normalize_machine, variant_named)

log = logging.getLogger("tokenserve.kernels")

KERNELS_ENV = "TOKENSERVE_KERNELS"
KERNELS_DIR = Path(__file__).parent

_lock = threading.Lock()
_libraries: dict[Path, object] = {}  # .so path -> the module tf.load_op_library returned
# what a library's load can fail with: each becomes the reason its ops fall back
LOAD_ERRORS = (OSError, RuntimeError, UnknownVariantError, subprocess.SubprocessError,
               tf.errors.OpError)


def forced_fallback(*mode_envs: str) -> str | None:
    """The variable (of `mode_envs`, then TOKENSERVE_KERNELS) that is set to "fallback", or
    None. Read on every call: a graph traced later sees a changed setting."""
    for name in (*mode_envs, KERNELS_ENV):
        if os.environ.get(name, "").strip().lower() == "fallback":
            return name
    return None


def _reason(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


RUNTIME_SOURCE = KERNELS_DIR / "helpers.cc"
_runtime: list[object] = []  # the runtime library once loaded (or the reason it is not)


def load_runtime() -> None:
    """Loads the op libraries' runtime (`helpers.cc`: the process's one helper team) with its
    symbols global, once per process, before any op library: each op library then finds it
    instead of starting a team of its own. It is located like an op library (a prebuilt
    variant, else built). On failure the op libraries still work, each with its own team."""
    with _lock:
        if _runtime:
            return
        try:
            path = prebuilt.locate("helpers", [RUNTIME_SOURCE]).path
            _runtime.append(ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL))
        except LOAD_ERRORS as e:
            log.warning("kernel runtime unavailable, each op library keeps its own helper "
                        "threads: %s", _reason(e))
            _runtime.append(_reason(e))


def load_op_file(path: Path) -> object:
    """tf.load_op_library of `path`, once per process per path."""
    with _lock:
        if path not in _libraries:
            _libraries[path] = tf.load_op_library(str(path))
        return _libraries[path]


def load_library(name: str, sources: Sequence[Path], what: str,
                 march_envs: Sequence[str] = ()) -> tuple[object, Located] | str:
    """Locates (prebuilt variant, else a build) and loads library `name`: (op module, where it
    came from), or the reason it is unavailable (str; logged as a warning naming `what`).
    Callers keep the outcome (one attempt per process)."""
    try:
        load_runtime()
        located = prebuilt.locate(name, sources, march_envs)
        module = load_op_file(located.path)
    except LOAD_ERRORS as e:
        log.warning("%s unavailable, using the pure-TF fallback: %s", what, _reason(e))
        return _reason(e)
    log.info("%s: %s", what, located.describe())
    return module, located


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
        'compiled dense op (AVX2+FMA; variant x86-64-v3 (-march=x86-64-v3) from ...)'
    """

    def __init__(self, name: str, sources: Sequence[str], what: str, mode_env: str,
                 info_op: str, march_env: str | None = None, detail: str = ""):
        self.name, self.what = name, what
        self.sources = tuple(KERNELS_DIR / source for source in sources)
        self.mode_env, self.march_env = mode_env, march_env
        self.info_op, self.detail = info_op, detail
        self._lock = threading.Lock()
        # (module, where it came from) once loaded, or why it is unavailable (str)
        self._loaded: tuple[object, Located] | str | None = None

    def forced_fallback(self) -> str | None:
        return forced_fallback(self.mode_env)

    def load(self) -> tuple[object, Located] | str:
        """Locates (a prebuilt variant, else a build) and loads the library once: (module,
        where it came from) or the reason it is unavailable."""
        with self._lock:
            if self._loaded is None:
                march = (self.march_env,) if self.march_env else ()
                self._loaded = load_library(self.name, self.sources, self.what, march)
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
        op, located = loaded
        isa = getattr(op, self.info_op)().numpy().decode()
        return f"compiled {self.what} ({isa}{self.detail}; {located.describe()})"

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
    OpLibrary("gguf_matmul", ["gguf_matmul.cc", "gguf_finish_block.cc"],
              "GGUF block matmul op",
              mode_env="TOKENSERVE_GGUF_KERNEL", info_op="tokenserve_gguf_matmul_info",
              march_env="TOKENSERVE_GGUF_KERNEL_MARCH",
              detail=", int8 activations, a scale per 8 values"),
    OpLibrary("moe", ["moe_experts.cc", "moe_layer.cc", "moe_gguf_layer.cc"],
              "mixture-of-experts op",
              mode_env="TOKENSERVE_MOE_KERNEL", info_op="tokenserve_moe_info"),
)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tokenserve.kernels.build",
        description="Load every op library as serving would (building what it must) and print "
                    "each one's status; or, with --all-variants, build every library for "
                    "every ISA variant of this machine, so that a copy of them (an image, a "
                    "wheel) needs no g++ and runs at each CPU's level.")
    parser.add_argument("--all-variants", action="store_true",
                        help="build every library (and the runtime) for every variant")
    parser.add_argument("--variants", default="",
                        help="comma-separated variant names (default: all of this machine's: "
                             + "; ".join(f"{machine}: {', '.join(v.name for v in family)}"
                                         for machine, family in VARIANTS.items()) + ")")
    parser.add_argument("--libraries", default="",
                        help="comma-separated library names (default: all: "
                             + ", ".join(LIBRARIES) + ")")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", type=Path, default=None,
                       help=f"directory to write them to (default: ${prebuilt.PREBUILT_ENV}, "
                            "else the user cache)")
    where.add_argument("--package", action="store_true",
                       help=f"write them into the installed package ({prebuilt.PACKAGED_DIR}),"
                            " where every copy of it finds them")
    return parser.parse_args(argv)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_variants(args: argparse.Namespace) -> int:
    """--all-variants: builds, prints a table and the variant this CPU loads; exit status 1
    if any build failed."""
    variants = ([variant_named(name) for name in _names(args.variants)] if args.variants
                else list(VARIANTS.get(normalize_machine(), ())))
    if not variants:
        print(f"no ISA variants are defined for {normalize_machine()}; "
              "`python -m tokenserve.kernels.build` builds for this CPU")
        return 1
    unknown = sorted(set(_names(args.libraries)) - set(LIBRARIES))
    if unknown:
        print(f"no op library is called {', '.join(unknown)}; there are: {', '.join(LIBRARIES)}")
        return 2
    chosen = _names(args.libraries) or list(LIBRARIES)
    libraries = {"helpers": [RUNTIME_SOURCE],
                 **{name: LIBRARIES[name].sources for name in chosen}}
    out_dir = prebuilt.PACKAGED_DIR if args.package else args.output or prebuilt.default_output()
    builds = build_all_variants(libraries, variants, out_dir)
    print(format_builds(builds))
    best = choose_variant(cpu_flag_set(), cap=isa_cap())
    print(f"this CPU loads variant {best.name if best else '(none: built for it instead)'}")
    return 0 if all(build.path for build in builds) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Loads every op library as serving would; prints one status line each. Exit status 1
    if any is unavailable (forced fallbacks count as fine). --all-variants: build_variants."""
    args = parse_args(argv)
    if not args.all_variants and (args.variants or args.libraries or args.output or args.package):
        print("--variants, --libraries, --output and --package go with --all-variants")
        return 2
    if args.all_variants:
        try:
            return build_variants(args)
        except UnknownVariantError as e:
            print(e)
            return 2
    ok = True
    for name, library in LIBRARIES.items():
        status = library.status()
        print(f"{name}: {status}")
        ok = ok and (status.startswith("compiled") or "=fallback" in status)
    return 0 if ok else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(main())
