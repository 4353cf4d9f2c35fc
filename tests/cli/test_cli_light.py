"""A light CLI: `tokenserve --help` and every command's `--help` import no TensorFlow (it
takes seconds to load), and TensorFlow's own logs stay quiet unless `--verbose`."""

from __future__ import annotations

import json
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
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
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


EXPORT = """
import logging, sys
logging.basicConfig(level=logging.INFO)  # as `tokenserve serve` sets up logging before it exports
from tokenserve.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # two first-run exports in child processes
def test_first_run_export_notices_show_only_with_verbose(tmp_path):
    """absl's INFO notices of an export (one per signature input it renames: "...contains
    input name(s) ... with unsupported characters...", pages for a real model) are dropped
    unless --verbose, even under a root logger at INFO, as `tokenserve serve`'s first run
    has it."""
    quiet = run_fresh("-c", EXPORT, "export", "tiny-gpt2", "--output", str(tmp_path / "a"))
    verbose = run_fresh("-c", EXPORT, "export", "tiny-gpt2", "--output", str(tmp_path / "b"),
                        "--verbose")
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert "unsupported characters" in verbose.stderr
    assert "unsupported characters" not in quiet.stderr
    assert (tmp_path / "a" / "1" / "saved_model.pb").exists()
