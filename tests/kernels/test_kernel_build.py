"""Where g++ is installed, every custom op library builds for this CPU with the default flags;
and what a library's cache entry is keyed on.

The op tests skip when an op is unavailable (the fallback tests still run), so a build that
fails on some CPU would otherwise pass unnoticed: on a CPU with AVX512-FP16, -march=native
once made TF's bundled Eigen fail to compile and every op silently fell back to pure TF."""

from __future__ import annotations

import importlib
import shutil

import pytest

from tokenserve.kernels import build, compiler

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")


@needs_gxx
@pytest.mark.parametrize("name", sorted(build.LIBRARIES))
def test_op_library_builds_with_the_default_flags(name, monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    library = build.LIBRARIES[name]
    arch = build.arch_flags()
    assert arch[0] == "-march=native"
    # raises if it fails; not loaded here: this process may load another build of it
    assert build.build_library(library.name, library.sources, arch).is_file()


def test_every_op_file_belongs_to_one_library():
    """A new op file that no library lists would never be compiled."""
    listed = [source.name for library in build.LIBRARIES.values() for source in library.sources]
    assert len(listed) == len(set(listed))
    on_disk = {path.name for path in build.KERNELS_DIR.glob("*.cc")}
    assert set(listed) == on_disk - {build.RUNTIME_SOURCE.name}


@pytest.mark.parametrize("name", sorted(build.LIBRARIES))
def test_each_op_module_takes_its_library_from_the_registry(name):
    assert importlib.import_module(f"tokenserve.kernels.{name}").LIBRARY is build.LIBRARIES[name]


def test_cache_key_covers_every_source_and_header(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    files = {name: tmp_path / name for name in ("a.cc", "b.cc", "shared.h")}
    for path in files.values():
        path.write_text("// v1\n")
    sources = [files["a.cc"], files["b.cc"]]
    before = build.library_path("lib", sources, ["-march=native"])
    assert before.name.startswith("lib-") and before.suffix == ".so"
    assert build.library_path("lib", sources, ["-march=native"]) == before
    seen = {before}
    for path in files.values():
        path.write_text("// v2\n")  # a change in any source or header beside them: a new build
        after = build.library_path("lib", sources, ["-march=native"])
        assert after not in seen
        seen.add(after)
    assert build.library_path("lib", sources, ["-mavx2", "-mfma"]) not in seen


@needs_gxx
def test_native_build_turns_avx512fp16_off_when_gxx_knows_it(monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    flags = build.arch_flags()
    assert flags[0] == "-march=native"
    assert set(flags[1:]) <= {"-mno-avx512fp16"}
    monkeypatch.setenv(build.MARCH_ENV, "avx2")
    assert build.arch_flags() == ["-mavx2", "-mfma"]


def test_native_build_on_a_cpu_without_avx512fp16_needs_no_probe(monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    monkeypatch.setattr(compiler, "cpu_flags", lambda: "fpu sse2 avx2 fma avx512f avx512bw")
    monkeypatch.setattr(compiler, "_no_avx512fp16", lambda: pytest.fail("g++ was probed"))
    assert build.arch_flags() == ["-march=native"]
