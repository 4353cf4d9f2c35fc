#!/usr/bin/env bash
# Sets up and runs the whole default test suite (slow tests: add `-m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export TF_CPP_MIN_LOG_LEVEL=3
exec .venv/bin/python -m pytest "$@"
