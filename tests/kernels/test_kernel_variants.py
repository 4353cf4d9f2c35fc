"""Which prebuilt ISA variant a CPU takes: the chooser over flag sets, real CPUs' flags planted
as /proc/cpuinfo files, the cap, and the table checked against what g++ says each -march
enables (a variant that needs a feature the chooser does not check would crash a CPU that
lacks it with SIGILL). Plain Python: no TensorFlow, no build."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.kernels.variants import (VARIANTS, UnknownVariantError, all_variants,
                                         choose_variant, normalize_machine,
                                         supported_variants, variant_named)

BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat clflush mmx fxsr sse sse2"
V2 = "pni ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm"
V3 = "avx avx2 fma f16c bmi1 bmi2 abm movbe xsave"
V4 = "avx512f avx512dq avx512cd avx512bw avx512vl"
# The flags lines of real CPUs, cut to what the variants read plus some of the rest, in
# /proc/cpuinfo's order where it matters nothing.
CPUS = {
    "nehalem (SSE4.2, no AVX)": (f"{BASE} {V2} nx rdtscp lm", "x86-64-v2"),
    "sandy bridge (AVX, no AVX2)": (f"{BASE} {V2} aes xsave avx nx lm", "x86-64-v2"),
    "haswell": (f"{BASE} {V2} {V3} aes rdrand erms invpcid", "x86-64-v3"),
    "zen 2": (f"{BASE} {V2} {V3} sse4a misalignsse sha_ni clzero", "x86-64-v3"),
    "skylake-sp (AVX-512, no VNNI)": (f"{BASE} {V2} {V3} {V4} clwb adx", "x86-64-v3"),
    "cascade lake": (f"{BASE} {V2} {V3} {V4} avx512_vnni clwb", "x86-64-v4-vnni"),
    "sapphire rapids": (f"{BASE} {V2} {V3} {V4} avx512_vnni avx512_bf16 avx_vnni amx_bf16 "
                        "amx_tile amx_int8 avx512_fp16", "x86-64-v4-vnni"),
    "zen 4": (f"{BASE} {V2} {V3} {V4} avx512_vnni avx512_bf16 avx512ifma", "x86-64-v4-vnni"),
    # a hypervisor that hides MOVBE: AVX2 is there, but x86-64-v3 code may use MOVBE
    "vm without movbe": (f"{BASE} {V2} {V3} {V4} avx512_vnni".replace(" movbe", ""),
                         "x86-64-v2"),
    "pre-SSE4.2 (core 2)": (f"{BASE} pni ssse3 cx16 lahf_lm", None),
}


def plant(tmp_path, flags: str, key: str = "flags") -> str:
    """A /proc/cpuinfo with two processors of `flags` (the reader takes the first line)."""
    path = tmp_path / "cpuinfo"
    block = f"processor\t: {{}}\nvendor_id\t: GenuineIntel\n{key}\t\t: {flags}\n\n"
    path.write_text(block.format(0) + block.format(1))
    return str(path)


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_a_planted_cpu_takes_the_best_variant_it_runs(cpu, tmp_path):
    flags, expected = CPUS[cpu]
    chosen = choose_variant(cpu_flag_set(plant(tmp_path, flags)), "x86_64")
    assert (chosen.name if chosen else None) == expected
    supported = supported_variants(cpu_flag_set(plant(tmp_path, flags)), "x86_64")
    assert [v.name for v in supported] == sorted((v.name for v in supported), reverse=True)


def test_an_aarch64_cpu_takes_its_baseline_and_an_unknown_machine_none(tmp_path):
    features = cpu_flag_set(plant(tmp_path, "fp asimd evtstrm aes crc32 atomics", "Features"))
    assert "asimd" in features
    assert choose_variant(features, "aarch64").name == "armv8-a"
    assert choose_variant(features, "arm64").name == "armv8-a"  # macOS spells it so
    assert choose_variant(cpu_flag_set(plant(tmp_path, CPUS["zen 4"][0])), "riscv64") is None


def test_the_cap_bounds_the_choice_from_above_only():
    cascade = frozenset(CPUS["cascade lake"][0].split())
    haswell = frozenset(CPUS["haswell"][0].split())
    assert choose_variant(cascade, "x86_64", cap="x86-64-v3").name == "x86-64-v3"
    assert choose_variant(cascade, "x86_64", cap="x86-64-v2").name == "x86-64-v2"
    # a cap above what the CPU runs changes nothing
    assert choose_variant(haswell, "x86_64", cap="x86-64-v4-vnni").name == "x86-64-v3"
    assert [v.name for v in supported_variants(cascade, "x86_64", cap="X86-64-V3")] == [
        "x86-64-v3", "x86-64-v2"]


def test_a_cap_that_names_no_variant_of_the_machine_is_refused():
    with pytest.raises(UnknownVariantError, match="there are: x86-64-v2, x86-64-v3"):
        supported_variants({"avx2"}, "x86_64", cap="avx2")
    with pytest.raises(UnknownVariantError, match="is for x86_64, not aarch64"):
        supported_variants({"asimd"}, "aarch64", cap="x86-64-v3")


def test_each_variant_needs_what_the_one_below_needs():
    """The chooser walks each machine's list from its end: a variant's requirements must
    include the lower ones', or a CPU could take a higher variant and lack a lower feature."""
    for family in VARIANTS.values():
        for lower, higher in zip(family, family[1:]):
            assert lower.requires < higher.requires, (lower.name, higher.name)
    assert len({v.name for v in all_variants()}) == len(all_variants())
    assert variant_named(" X86-64-V3 ").name == "x86-64-v3"
    assert normalize_machine("AMD64") == "x86_64"


# What g++'s predefined macros for a target mean in /proc/cpuinfo's names.
MACRO_FLAGS = {"SSE3": "pni", "SSSE3": "ssse3", "SSE4_1": "sse4_1", "SSE4_2": "sse4_2",
               "POPCNT": "popcnt", "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c",
               "BMI": "bmi1", "BMI2": "bmi2", "LZCNT": "abm", "MOVBE": "movbe",
               "XSAVE": "xsave", "AVX512F": "avx512f", "AVX512BW": "avx512bw",
               "AVX512CD": "avx512cd", "AVX512DQ": "avx512dq", "AVX512VL": "avx512vl",
               "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16",
               "AVX512FP16": "avx512_fp16", "AMX_TILE": "amx_tile", "AVXVNNI": "avx_vnni",
               "AVX512IFMA": "avx512ifma", "AVX512VBMI": "avx512vbmi"}


@pytest.mark.skipif(shutil.which("g++") is None or normalize_machine() != "x86_64",
                    reason="needs g++ for x86-64")
@pytest.mark.parametrize("name", [v.name for v in VARIANTS["x86_64"]])
def test_every_feature_a_variant_is_compiled_for_is_one_the_chooser_checks(name):
    variant = variant_named(name)
    macros = subprocess.run(["g++", *variant.march, "-dM", "-E", "-x", "c++", "/dev/null"],
                            capture_output=True, text=True, check=True).stdout
    enabled = {MACRO_FLAGS[m] for m in re.findall(r"#define __(\w+)__ 1", macros)
               if m in MACRO_FLAGS}
    assert "sse4_2" in enabled  # the macros were read at all
    assert enabled <= variant.requires, f"{name} compiles for {enabled - variant.requires}"
    if "avx512_vnni" in variant.requires:  # the VNNI kernels are compiled only where these are
        assert {"__AVX512VNNI__", "__AVX512VL__", "__AVX512F__"} <= set(
            re.findall(r"#define (__AVX512\w+__) 1", macros))
