#!/usr/bin/env bash
# Creates .venv with tokenserve installed (editable). `scripts/setup.sh test` adds the test
# extras, `scripts/setup.sh bench` the benchmark extras (keras-hub, matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "tokenserve needs Python 3.11"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
extras=${1:-}
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet --editable "$spec"
.venv/bin/python -m tokenserve.kernels.int8_matmul || true  # pre-build the int8 matmul op
