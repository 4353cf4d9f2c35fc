"""The ISA variants the op libraries are prebuilt for, and which one a CPU runs.

As llama.cpp does with GGML_CPU_ALL_VARIANTS, `python -m tokenserve.kernels.build
--all-variants` compiles every op library once per variant, each with its own -march, and the
loader takes the best variant the CPU's flags allow. An image (or a wheel) built on one CPU
then runs on another at that CPU's level, with no compiler there.

What differs between the variants:
  x86-64-v2       SSE4.2 and POPCNT: the baseline every x86-64 CPU of the last 15 years has.
                  The ops' AVX2 kernels carry their own target attribute and still run where
                  the CPU has AVX2 (cpu.h checks at run time); the code around them is SSE.
  x86-64-v3       AVX2, FMA, F16C, BMI2, MOVBE (Haswell and later, every Zen).
  x86-64-v4-vnni  AVX-512 F/BW/CD/DQ/VL and AVX512-VNNI (Cascade Lake, Ice Lake, Sapphire
                  Rapids and later; Zen 4 and later): the only build with the int8 and GGUF
                  ops' VNNI kernels, which their sources compile only where the build's flags
                  include AVX-512.
  armv8-a         the aarch64 baseline (the ops have no NEON kernels; their scalar ones run).
There is no bfloat16 or AMX variant: no op has such a kernel (the expert op widens bfloat16
weights in scalar code), so it would differ from x86-64-v4-vnni only in what g++ emits by
itself. Add one here when an op grows such a path; the rest follows from this table.

Environment (read when a library loads, not at import):
  TOKENSERVE_KERNELS_ISA=x86-64-v3   the best variant to take (a cap: a CPU with more still
                                     gets this one; one with less gets what it runs). Where
                                     no prebuilt variant fits, that capped variant is built
                                     rather than -march=native.

Plain Python, no TensorFlow: tests and the chooser's callers read it without loading TF.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Collection
from dataclasses import dataclass

ISA_ENV = "TOKENSERVE_KERNELS_ISA"


class UnknownVariantError(ValueError):
    """A variant name (TOKENSERVE_KERNELS_ISA, --variants) that no variant has."""


@dataclass(frozen=True)
class Variant:
    """One ISA level the op libraries are prebuilt for.

    Args:
        name: what files, logs and TOKENSERVE_KERNELS_ISA call it ("x86-64-v3").
        machine: the architecture it runs on, as `normalize_machine` spells it.
        march: g++'s target flags for it.
        requires: the /proc/cpuinfo flags a CPU needs to run code built with `march`.
        summary: what it adds, in logs and `--all-variants` output.
    """

    name: str
    machine: str
    march: tuple[str, ...]
    requires: frozenset[str]
    summary: str


_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"})
# "abm" is how Linux names LZCNT on Intel and AMD alike; x86-64-v3 code may use it and MOVBE,
# so a hypervisor that hides either must not get this variant
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Per machine, worst to best: the chooser walks each list from its end.
VARIANTS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("x86-64-v2", "x86_64", ("-march=x86-64-v2",), _V2, "SSE4.2 baseline"),
        Variant("x86-64-v3", "x86_64", ("-march=x86-64-v3",), _V3, "AVX2+FMA+F16C"),
        Variant("x86-64-v4-vnni", "x86_64", ("-march=x86-64-v4", "-mavx512vnni"),
                _V4 | {"avx512_vnni"}, "AVX-512 with VNNI"),
    ),
    "aarch64": (
        Variant("armv8-a", "aarch64", ("-march=armv8-a",), frozenset(), "ARMv8-A baseline"),
    ),
}


def normalize_machine(machine: str | None = None) -> str:
    """platform.machine() (or `machine`) as VARIANTS keys it: "x86_64", "aarch64", else
    lowercase as given (a machine with no variants)."""
    name = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(name, name)


def all_variants() -> tuple[Variant, ...]:
    """Every variant of every machine."""
    return tuple(variant for family in VARIANTS.values() for variant in family)


def variant_named(name: str) -> Variant:
    """The variant called `name`; UnknownVariantError listing the names otherwise."""
    for variant in all_variants():
        if variant.name == name.strip().lower():
            return variant
    raise UnknownVariantError(f"no kernel variant is called {name!r}; there are: "
                              + ", ".join(v.name for v in all_variants()))


def supported_variants(flags: Collection[str], machine: str | None = None,
                       cap: str | None = None) -> tuple[Variant, ...]:
    """The variants a CPU with `flags` runs, best first, none above `cap`.

    Args:
        flags: the CPU's flags as /proc/cpuinfo names them (host.cpu_flags.cpu_flag_set).
        machine: its architecture (default: this machine's).
        cap: the name of the best variant to consider (None: no cap).

    Returns:
        () where the machine has no variants or the CPU runs none (then the loader builds
        for the CPU itself).

    Example:
        >>> [v.name for v in supported_variants({"avx2", ...}, "x86_64")]
        ['x86-64-v3', 'x86-64-v2']
    """
    family = VARIANTS.get(normalize_machine(machine), ())
    if cap is not None:
        capped = variant_named(cap)
        if capped not in family:
            raise UnknownVariantError(f"kernel variant {capped.name} is for {capped.machine},"
                                      f" not {normalize_machine(machine)}")
        family = family[:family.index(capped) + 1]
    have = frozenset(flags)
    return tuple(variant for variant in reversed(family) if variant.requires <= have)


def choose_variant(flags: Collection[str], machine: str | None = None,
                   cap: str | None = None) -> Variant | None:
    """The best variant a CPU with `flags` runs (none above `cap`), or None."""
    supported = supported_variants(flags, machine, cap)
    return supported[0] if supported else None


def isa_cap() -> str | None:
    """TOKENSERVE_KERNELS_ISA, read now (None when unset or empty)."""
    return os.environ.get(ISA_ENV, "").strip() or None
