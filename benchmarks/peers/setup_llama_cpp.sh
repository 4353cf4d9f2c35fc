#!/usr/bin/env bash
# Creates the virtualenv of the llama.cpp peer: llama-cpp-python (llama.cpp built from its
# PyPI source distribution for this CPU, GGML_NATIVE) with its OpenAI-compatible server.
# Used by benchmarks/peers/gpt2_gguf.py and benchmarks/headline.py
# (`--systems llamacpp-f32 llamacpp-q8_0`).
#
#   bash benchmarks/peers/setup_llama_cpp.sh [VENV]
#
# VENV defaults to $LLAMA_CPP_VENV, else benchmarks/.venv-llama-cpp. Building llama.cpp takes
# about 10 minutes on 2 cores (it needs a C++ compiler; cmake comes from PyPI). Idempotent:
# a VENV that already imports the pinned version is left as it is.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-${LLAMA_CPP_VENV:-$root/benchmarks/.venv-llama-cpp}}"
python="${PYTHON:-python3}"
version="0.3.36"

have() {
    "$venv/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" \
        2>/dev/null
}

if [[ -x "$venv/bin/python" ]] && have; then
    echo "llama.cpp peer venv $venv is ready (llama-cpp-python $version)"
else
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --upgrade --quiet pip
    echo "building llama-cpp-python $version (llama.cpp from source, -march=native) ..."
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
        "$venv/bin/python" -m pip install --quiet --no-cache-dir \
        "llama-cpp-python[server]==$version"
    have
fi
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, \
'system info:', llama_cpp.llama_print_system_info().decode().strip())"
