"""Each ISA variant this CPU runs, built with its capped -march and loaded in a fresh process
that has no g++ on its PATH, TOKENSERVE_KERNELS_ISA forcing the choice: the int8 op loads
that variant's file and gives the float64 reference's numbers. On a CPU with AVX512-VNNI, the
capped variants must not run the VNNI kernels (only x86-64-v4-vnni compiles them).

The int8 library (and the runtime) only, built into a folder of the user cache that serving
does not search (TOKENSERVE_KERNELS_DIR names it to the probe), so a second run builds
nothing. All of it is `-m slow`: a first run compiles each variant (about a minute on two
busy cores); the default run checks the chooser and the load order without a compiler
(test_kernel_variants.py, test_kernel_prebuilt.py). Every library as every variant, the way
the image builds them, is tests/deploy/test_docker_kernels.py's slow test."""

from __future__ import annotations

import shutil

import pytest

from support.kernel_variants import check_report, probe
from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.host.user_cache import cache_dir
from tokenserve.kernels import build
from tokenserve.kernels.prebuilt import PREBUILT_ENV, build_variant
from tokenserve.kernels.variants import ISA_ENV, supported_variants, variant_named

LIBRARY = build.LIBRARIES["int8_matmul"]
HERE = supported_variants(cpu_flag_set())
VARIANTS_DIR = cache_dir("kernel-variant-tests")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the variants")
@pytest.mark.slow  # compiles an op library per variant (about a minute each on 2 cores)
@pytest.mark.parametrize("name", [variant.name for variant in HERE])
def test_each_variant_loads_without_a_compiler_and_matches_the_reference(name, tmp_path):
    variant = variant_named(name)
    for library, sources in (("helpers", [build.RUNTIME_SOURCE]),
                             (LIBRARY.name, LIBRARY.sources)):
        build_variant(library, sources, variant, VARIANTS_DIR)
    check_report(probe(tmp_path / "bin", {ISA_ENV: name, PREBUILT_ENV: str(VARIANTS_DIR)}),
                 name)

