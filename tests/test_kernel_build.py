"""Where g++ is installed, every custom op builds for this CPU with the default flags.

The op tests skip when an op is unavailable (the fallback tests still run), so a build that
fails on some CPU would otherwise pass unnoticed: on a CPU with AVX512-FP16, -march=native
once made TF's bundled Eigen fail to compile and every op silently fell back to pure TF."""

from __future__ import annotations

import shutil

import pytest

from tokenserve.kernels import build, dense, half_matmul, int8_matmul, paged_attention

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")


@pytest.mark.parametrize("source", [dense.LIBRARY.source, int8_matmul.LIBRARY.source,
                                    paged_attention.LIBRARY.source, half_matmul.LIBRARY.source],
                         ids=lambda path: path.stem)
def test_op_builds_with_the_default_flags(source, monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    loaded = build.load_library(source, build.arch_flags(), source.stem)
    assert not isinstance(loaded, str), f"{source.name} failed to build: {loaded}"
    assert loaded[1].startswith("-march=native")


def test_native_build_turns_avx512fp16_off_when_gxx_knows_it(monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    flags = build.arch_flags()
    assert flags[0] == "-march=native"
    assert set(flags[1:]) <= {"-mno-avx512fp16"}
    monkeypatch.setenv(build.MARCH_ENV, "avx2")
    assert build.arch_flags() == ["-mavx2", "-mfma"]


def test_native_build_on_a_cpu_without_avx512fp16_needs_no_probe(monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu sse2 avx2 fma avx512f avx512bw")
    monkeypatch.setattr(build, "_no_avx512fp16", lambda: pytest.fail("g++ was probed"))
    assert build.arch_flags() == ["-march=native"]
