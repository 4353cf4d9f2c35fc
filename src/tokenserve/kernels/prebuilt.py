"""Which file an op library loads from: a prebuilt ISA variant, else a build for this CPU.

`locate` is the policy, in this order:
  1. TOKENSERVE_KERNELS_MARCH (or the library's own march variable) set: build for that
     target, as before variants existed (benchmarks cap the ops at AVX2 this way).
  2. The best variant this CPU runs (variants.py; at most TOKENSERVE_KERNELS_ISA), prebuilt
     in one of `search_dirs()` (the first that holds it).
  3. Not prebuilt: build with g++, for that capped variant when TOKENSERVE_KERNELS_ISA is
     set, else -march=native, into the user cache (a build cached before needs no g++).
  4. No g++: a lower prebuilt variant, with a warning (slower than the CPU could run, but
     compiled); none either: MissingVariantError naming the variant it looked for and where.

A variant's file is `<name>-<variant>-<key>.so`, the key hashing the sources, headers, TF's
version and the flags without TF's -I/-L paths (a venv copied to another machine, or TF at
another path, builds the same library), not the CPU: a prebuilt directory is shared by every
CPU that runs the variant, and a stale one (other sources, other TF) is never matched.

Environment (read when a library loads):
  TOKENSERVE_KERNELS_DIR=/dir   searched first for prebuilt variants, and where
                                `--all-variants` writes by default
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf

from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.host.user_cache import cache_dir
from tokenserve.kernels.compiler import (CompilerNotFoundError, KernelBuildError, arch_flags,
                                         build_library, compile_flags, explicit_march,
                                         library_key)
from tokenserve.kernels.variants import (Variant, isa_cap, normalize_machine,
                                         supported_variants)

log = logging.getLogger("tokenserve.kernels")

PREBUILT_ENV = "TOKENSERVE_KERNELS_DIR"
# Inside the installed package: what `--all-variants --package` writes, so a copied venv
# (the Docker image's) carries its kernels with it.
PACKAGED_DIR = Path(__file__).parent / "prebuilt"


class MissingVariantError(KernelBuildError):
    """No prebuilt variant this CPU runs, and no g++ to build one."""


@dataclass(frozen=True)
class Located:
    """The .so an op library loads and how it came to be.

    Args:
        path: the shared library.
        flags: the target flags it was built with ("-march=x86-64-v3").
        variant: the prebuilt variant it is, or None (built for this CPU).
    """

    path: Path
    flags: str
    variant: Variant | None = None

    def describe(self) -> str:
        """For status lines and logs: "variant x86-64-v3 (-march=x86-64-v3) from /dir" or
        "built with -march=native"."""
        if self.variant is None:
            return f"built with {self.flags}"
        return f"variant {self.variant.name} ({self.flags}) from {self.path.parent}"


def search_dirs() -> list[Path]:
    """Where prebuilt variants are looked for, in order: TOKENSERVE_KERNELS_DIR (when set),
    the installed package's prebuilt/, the user cache's kernels/."""
    named = os.environ.get(PREBUILT_ENV, "").strip()
    return [*([Path(named)] if named else []), PACKAGED_DIR, cache_dir("kernels")]


def default_output() -> Path:
    """Where `--all-variants` writes unless told: TOKENSERVE_KERNELS_DIR, else the user cache."""
    named = os.environ.get(PREBUILT_ENV, "").strip()
    return Path(named) if named else cache_dir("kernels")


def variant_file(name: str, sources: Sequence[Path], variant: Variant) -> str:
    """The file name of library `name` built from `sources` as `variant`."""
    flags = compile_flags(variant.march) + tf.sysconfig.get_link_flags()
    portable = [flag for flag in flags if not flag.startswith(("-I", "-L"))]
    return f"{name}-{variant.name}-{library_key(sources, portable)}.so"


def find_prebuilt(name: str, sources: Sequence[Path], variants: Sequence[Variant],
                  dirs: Sequence[Path]) -> Located | None:
    """The first of `variants` (best first) prebuilt in any of `dirs`, or None."""
    for variant in variants:
        file = variant_file(name, sources, variant)
        for directory in dirs:
            if (directory / file).is_file():
                return Located(directory / file, " ".join(variant.march), variant)
    return None


def build_variant(name: str, sources: Sequence[Path], variant: Variant, out_dir: Path) -> Path:
    """Builds library `name` as `variant` into `out_dir` (unless there) and returns its path.
    g++ builds any x86 variant on any x86 CPU; only loading it needs the CPU to run it."""
    return build_library(name, sources, variant.march, out_dir / variant_file(name, sources,
                                                                              variant))


def locate(name: str, sources: Sequence[Path], march_envs: Sequence[str] = ()) -> Located:
    """The library `name` to load here, built if it must be (the policy above).

    Raises:
        MissingVariantError: nothing prebuilt fits and there is no g++.
        KernelBuildError: a needed build failed.
        UnknownVariantError: TOKENSERVE_KERNELS_ISA names no variant of this machine.
    """
    if explicit_march(*march_envs):
        arch = arch_flags(*march_envs)
        return Located(build_library(name, sources, arch), " ".join(arch))
    cap = isa_cap()
    variants = supported_variants(cpu_flag_set(), cap=cap)
    dirs = search_dirs()
    best = find_prebuilt(name, sources, variants[:1], dirs)
    if best is not None:
        return best
    try:
        if cap is not None and variants:
            variant = variants[0]
            path = build_variant(name, sources, variant, cache_dir("kernels"))
            return Located(path, " ".join(variant.march), variant)
        arch = arch_flags()
        return Located(build_library(name, sources, arch), " ".join(arch))
    except CompilerNotFoundError:
        lower = find_prebuilt(name, sources, variants[1:], dirs)
        if lower is None:
            raise MissingVariantError(_missing(name, variants, dirs)) from None
    log.warning("%s: no prebuilt %s variant (the best this CPU runs%s) and no g++ to build "
                "it; taking %s", name, variants[0].name, " under the cap" if cap else "",
                lower.variant.name)
    return lower


def _missing(name: str, variants: Sequence[Variant], dirs: Sequence[Path]) -> str:
    where = ", ".join(str(directory) for directory in dirs)
    if not variants:
        return (f"g++ not found, and no prebuilt variant of {name} runs on this "
                f"{normalize_machine()} CPU; install g++ to build it here")
    lower = f" or lower ({', '.join(v.name for v in variants[1:])})" if variants[1:] else ""
    return (f"g++ not found, and no prebuilt {variants[0].name} variant of {name}{lower} in "
            f"{where}: run `python -m tokenserve.kernels.build --all-variants` where g++ is, "
            f"or set {PREBUILT_ENV} to a directory holding them")
