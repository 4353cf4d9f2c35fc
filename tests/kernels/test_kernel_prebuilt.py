"""Where an op library's file comes from (prebuilt.locate), with planted files and no build:
the best prebuilt variant this CPU runs, directory order, the cap, stale files never matched,
TOKENSERVE_KERNELS_MARCH bypassing variants, and the error that names the missing variant
where nothing fits and there is no g++."""

from __future__ import annotations

import shutil

import pytest

from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.kernels import build, prebuilt
from tokenserve.kernels.compiler import MARCH_ENV, CompilerNotFoundError
from tokenserve.kernels.variants import ISA_ENV, supported_variants, variant_named

LIBRARY = build.LIBRARIES["int8_matmul"]
HERE = supported_variants(cpu_flag_set())  # what this CPU runs, best first
needs_two = pytest.mark.skipif(len(HERE) < 2, reason="this CPU runs fewer than two variants")


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """An env-named prebuilt directory and an empty user cache; no cap, no -march."""
    for name in (ISA_ENV, MARCH_ENV, LIBRARY.march_env):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(prebuilt.PREBUILT_ENV, str(tmp_path / "named"))
    (tmp_path / "named").mkdir()
    return tmp_path


def plant(directory, variant, sources=LIBRARY.sources):
    path = directory / prebuilt.variant_file(LIBRARY.name, sources, variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF planted")
    return path


def locate():
    return prebuilt.locate(LIBRARY.name, LIBRARY.sources, (LIBRARY.march_env,))


@needs_two
def test_the_best_prebuilt_variant_this_cpu_runs_is_taken(dirs):
    for variant in HERE:
        plant(dirs / "named", variant)
    located = locate()
    assert located.variant == HERE[0] and located.path.parent == dirs / "named"
    assert located.describe().startswith(f"variant {HERE[0].name} (")


@needs_two
def test_without_gxx_a_lower_variant_is_taken_when_the_best_is_missing(dirs, monkeypatch,
                                                                        caplog):
    plant(dirs / "named", HERE[1])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert locate().variant == HERE[1]
    assert f"no prebuilt {HERE[0].name} variant" in caplog.text


@needs_two
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_with_gxx_the_cpu_gets_its_own_build_rather_than_a_lower_variant(dirs, monkeypatch):
    """The native build is in the real user cache once test_kernel_build.py has run."""
    monkeypatch.delenv("XDG_CACHE_HOME")
    plant(dirs / "named", HERE[1])
    located = locate()
    assert located.variant is None and located.flags.startswith("-march=native")


@needs_two
def test_the_cap_forces_a_lower_variant(dirs, monkeypatch):
    for variant in HERE:
        plant(dirs / "named", variant)
    monkeypatch.setenv(ISA_ENV, HERE[1].name)
    assert locate().variant == HERE[1]


@pytest.mark.skipif(not HERE, reason="no variant runs on this CPU")
def test_the_named_directory_comes_before_the_user_cache(dirs):
    cached = plant(dirs / "cache" / "tokenserve" / "kernels", HERE[0])
    assert locate().path == cached
    named = plant(dirs / "named", HERE[0])
    assert locate().path == named


@pytest.mark.skipif(not HERE, reason="no variant runs on this CPU")
def test_a_variant_built_from_other_sources_is_not_matched(dirs, monkeypatch, tmp_path):
    old = tmp_path / "old.cc"
    old.write_text("// an older int8_matmul.cc\n")
    plant(dirs / "named", HERE[0], sources=(old,))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(prebuilt.MissingVariantError):
        locate()


@pytest.mark.skipif(not HERE, reason="no variant runs on this CPU")
def test_an_explicit_march_builds_rather_than_takes_a_variant(dirs, monkeypatch):
    plant(dirs / "named", HERE[0])
    monkeypatch.setenv(MARCH_ENV, "avx2")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(CompilerNotFoundError):  # it went to build, not to the planted file
        locate()


@pytest.mark.skipif(not HERE, reason="no variant runs on this CPU")
def test_no_variant_and_no_compiler_names_what_is_missing(dirs, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(prebuilt.MissingVariantError) as error:
        locate()
    message = str(error.value)
    assert message.startswith(f"g++ not found, and no prebuilt {HERE[0].name} variant of "
                              f"{LIBRARY.name}")
    assert str(dirs / "named") in message and "--all-variants" in message
    # the library falls back to pure TF, with that reason in its status
    monkeypatch.setattr(build, "_runtime", ["not loaded in this test"])
    monkeypatch.setattr(LIBRARY, "_loaded", None)
    monkeypatch.delenv(LIBRARY.mode_env, raising=False)
    monkeypatch.delenv(build.KERNELS_ENV, raising=False)
    assert LIBRARY.status() == f"pure-TF fallback: {message}"


def test_an_unknown_cap_is_the_reason_the_library_falls_back(dirs, monkeypatch):
    monkeypatch.setenv(ISA_ENV, "avx9000")
    monkeypatch.setattr(build, "_runtime", ["not loaded in this test"])
    monkeypatch.setattr(LIBRARY, "_loaded", None)
    monkeypatch.delenv(LIBRARY.mode_env, raising=False)
    monkeypatch.delenv(build.KERNELS_ENV, raising=False)
    assert LIBRARY.status().startswith("pure-TF fallback: no kernel variant is called 'avx9000'")


def test_variant_files_are_keyed_on_sources_and_variant_not_on_paths(tmp_path):
    v2, v3 = variant_named("x86-64-v2"), variant_named("x86-64-v3")
    names = {prebuilt.variant_file("lib", LIBRARY.sources, v) for v in (v2, v3)}
    assert len(names) == 2 and all(n.startswith("lib-x86-64-v") for n in names)
    copy = tmp_path / LIBRARY.sources[0].name
    shutil.copy(LIBRARY.sources[0], copy)  # same bytes and name elsewhere: same key, if the
    for header in LIBRARY.sources[0].parent.glob("*.h"):  # headers beside it are the same
        shutil.copy(header, tmp_path / header.name)
    assert (prebuilt.variant_file("lib", [copy], v3)
            == prebuilt.variant_file("lib", [LIBRARY.sources[0]], v3))


def test_the_cli_refuses_what_it_cannot_build_before_building_anything(capsys):
    assert build.main(["--all-variants", "--variants", "x86-64-v3,avx9"]) == 2
    assert "no kernel variant is called 'avx9'; there are: x86-64-v2" in capsys.readouterr().out
    assert build.main(["--all-variants", "--libraries", "int8,moe"]) == 2
    assert "no op library is called int8; there are: int8_matmul" in capsys.readouterr().out
    assert build.main(["--package"]) == 2  # --package without --all-variants
    with pytest.raises(SystemExit):
        build.main(["--all-variants", "--package", "--output", "/tmp/x"])  # one or the other
