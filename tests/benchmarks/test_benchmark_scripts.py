"""Every benchmark script answers --help with its usage, without importing TensorFlow.

So each one parses its arguments before anything heavy, and every import at its top (its
neighbours `common` and `peer_systems`, the tokenserve modules it names) resolves against
the package as it is now: a module moved in src/ fails here, not in the next benchmark run.
Canonical scripts run as `python benchmarks/NAME.py`, experiments as
`python -m benchmarks.experiments.NAME` from the repository's root, as their docstrings say.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO_ROOT as ROOT

BENCHMARKS = ROOT / "benchmarks"


def _is_script(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if _is_script(p))
EXPERIMENTS = sorted(p for p in (BENCHMARKS / "experiments").glob("*.py") if _is_script(p))


def _command(path: Path) -> list[str]:
    if path.parent == BENCHMARKS:
        return [str(path)]
    return ["-m", ".".join(path.relative_to(ROOT).with_suffix("").parts)]


@pytest.fixture(scope="module")
def helps() -> dict[Path, tuple[int, str, str]]:
    """(exit status, stdout, stderr) of `--help` of every script, all started at once.

    `-X importtime` lists every module each imports on stderr."""
    running = {path: subprocess.Popen(
        [sys.executable, "-X", "importtime", *_command(path), "--help"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for path in SCRIPTS + EXPERIMENTS}
    results = {}
    for path, process in running.items():
        out, err = process.communicate(timeout=120)
        results[path] = (process.returncode, out, err)
    return results


def test_the_canonical_scripts_are_found():
    names = {p.stem for p in SCRIPTS}
    assert {"headline", "one_stream", "throughput", "decode"} <= names
    assert not {"common", "peer_systems", "step_times"} & names  # modules, not scripts


@pytest.mark.parametrize("path", SCRIPTS + EXPERIMENTS,
                         ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_help_prints_usage_without_tensorflow(helps, path):
    status, out, err = helps[path]
    errors = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert status == 0, "\n".join(errors[-20:])
    assert out.startswith("usage: ")
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines()
                if line.startswith("import time:")}
    assert "tensorflow" not in imported, "imports TensorFlow before parsing its arguments"
