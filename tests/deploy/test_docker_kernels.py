"""The image's custom ops: its build stage builds every op library for every ISA variant into
the installed package, and its final stage, with no compiler, loads the best one a CPU runs.

There is no Docker daemon (and no registry for the python:3.11-slim base) on these machines,
so the image is not built. The Dockerfile's instructions are checked here, and the slow test
runs its build stage's kernel command against a copy of the package (what `pip install /src`
puts in the venv), then loads each variant from that copy as the final stage would: no g++
on the PATH, an empty user cache.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from deploy.local.configs import DEPLOY
from support.kernel_variants import OTHER_CHOICES, check_report, probe
from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.kernels import build, prebuilt
from tokenserve.kernels.variants import ISA_ENV, VARIANTS, normalize_machine, supported_variants

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
PACKAGE = build.KERNELS_DIR.parent  # src/tokenserve


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), per stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            op, args = line.split(None, 1)
            if op.upper() == "FROM":
                result.append([])
            result[-1].append((op.upper(), args.strip()))
    return result


def kernels_command() -> str:
    """The build stage's RUN that builds the ops."""
    commands = [args for op, args in stages()[0] if op == "RUN" and "tokenserve.kernels" in args]
    assert len(commands) == 1, commands
    return commands[0]


def test_the_build_stage_builds_every_variant_into_the_package_after_installing_it():
    build_stage = stages()[0]
    runs = [args for op, args in build_stage if op == "RUN"]
    command = kernels_command()
    assert runs.index(command) > next(i for i, run in enumerate(runs) if "pip install /src" in run)
    assert any("g++" in run for run in runs[:runs.index(command)])
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "tokenserve.kernels.build"]
    assert "||" not in words and ";" not in command  # a failed build fails the image
    args = build.parse_args(words[3:])
    assert args.all_variants and args.package  # into the venv the final stage copies
    assert not args.variants and not args.libraries  # every variant, every library
    assert prebuilt.PACKAGED_DIR.is_relative_to(PACKAGE)


def test_the_final_stage_has_no_compiler_and_copies_the_venv_with_the_variants():
    final = stages()[-1]
    runs = " ".join(args for op, args in final if op == "RUN")
    assert not re.search(r"\b(g\+\+|gcc|build-essential|clang)\b", runs)
    assert any(op == "COPY" and args.split()[:2] == ["--from=build", "/opt/tokenserve"]
               for op, args in final)
    assert any(op == "RUN" and "/opt/tokenserve/venv" in args for op, args in stages()[0])
    env = " ".join(args for op, args in final if op == "ENV")
    for name in (build.MARCH_ENV, build.KERNELS_ENV, ISA_ENV):  # none may force a build or
        assert name not in env  # the fallback, or cap every CPU the image runs on


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or normalize_machine() not in VARIANTS,
                    reason="needs g++ and a machine with variants")
def test_the_build_stage_command_builds_what_the_final_stage_loads_without_a_compiler(
        tmp_path):
    """Every library as every variant (21 builds on x86-64): over an hour on two busy cores,
    where one translation unit took 20 to 140 s; minutes on a many-core build machine."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "tokenserve",
                    ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
    tools = tmp_path / "bin"  # `python` as the image's PATH finds it
    tools.mkdir()
    (tools / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (tools / "python").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in OTHER_CHOICES}
    stage = {**base, "PYTHONPATH": str(site), "XDG_CACHE_HOME": str(tmp_path / "build-cache"),
             "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(["sh", "-c", kernels_command()], env=stage, capture_output=True,
                            text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    variants = VARIANTS[normalize_machine()]
    built = sorted((site / "tokenserve" / "kernels" / "prebuilt").glob("*.so"))
    assert len(built) == (len(build.LIBRARIES) + 1) * len(variants), built
    assert not (tmp_path / "build-cache" / "tokenserve" / "kernels").exists()

    # the final stage: the same package, no g++, nothing in the user cache
    final = {"PYTHONPATH": str(site), "XDG_CACHE_HOME": str(tmp_path / "final-cache")}
    for variant in supported_variants(cpu_flag_set()):
        report = probe(tmp_path / "empty", {**final, ISA_ENV: variant.name}, "--all")
        check_report(report, variant.name)
        assert report["path"].startswith(str(site))
        for name, status in report["statuses"].items():
            assert status.startswith("compiled") and f"variant {variant.name} (" in status, (
                name, status)
    assert not (tmp_path / "final-cache" / "tokenserve" / "kernels").exists()
