"""A light CLI: `tokenserve --help` and every command's `--help` import no TensorFlow (it
takes seconds to load), and TensorFlow's own logs stay quiet unless `--verbose`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

HEAVY = ("tensorflow", "keras", "tf_keras")

PROBE = """
import json, sys
from tokenserve.cli.main import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit as exit:
    code = exit.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def run_fresh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_tokenserve_help_imports_no_tensorflow():
    """The real entry point, as the console script runs it, traced by -X importtime."""
    result = run_fresh("-X", "importtime", "-m", "tokenserve", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: tokenserve" in result.stdout and "serve" in result.stdout
    imported = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "tokenserve.cli.main" in imported  # the trace really covers the CLI
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []


@pytest.mark.parametrize("command", ["bench", "serve", "generate", "export", "eval", "train",
                                     "prune", "optimize"])
def test_command_help_imports_no_tensorflow(command):
    result = run_fresh("-c", PROBE, json.dumps([command, "--help"]), json.dumps(HEAVY))
    outcome = json.loads(result.stderr.strip().splitlines()[-1])
    assert outcome == {"code": 0, "heavy": []}
    assert f"usage: tokenserve {command}" in result.stdout and "--verbose" in result.stdout


def test_tensorflow_notices_show_only_with_verbose(monkeypatch):
    """absl's and TensorFlow's INFO notices (pages of them on a first-run export) are
    dropped unless --verbose; their warnings always show."""
    from tokenserve.cli import main as cli

    for name in ("absl", "tensorflow"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    cli._library_logs(verbose=False)
    assert not logging.getLogger("absl").isEnabledFor(logging.INFO)
    assert logging.getLogger("absl").isEnabledFor(logging.WARNING)
    assert not logging.getLogger("tensorflow").isEnabledFor(logging.INFO)
    cli._library_logs(verbose=True)
    assert logging.getLogger("absl").isEnabledFor(logging.INFO)
