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
# a VENV that already imports the pinned version, built with the same CMake arguments (kept
# in VENV/.llama-cpp-cmake-args), is left as it is.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-${LLAMA_CPP_VENV:-$root/benchmarks/.venv-llama-cpp}}"
python="${PYTHON:-python3}"
version="0.3.36"

# llama.cpp's AMX int8 matmul (ggml_backend_amx_mul_mat) crashes in the first decode of a
# q8_0 model on some Sapphire Rapids VMs (a known, unfixed llama.cpp bug; seen here with
# 0.3.36: segmentation fault on the first request). On a CPU with AMX the build leaves that
# backend out; q8_0 then runs on llama.cpp's AVX512-VNNI kernels, as on any other AVX-512 CPU.
cmake_args="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
if [[ -z "${CMAKE_ARGS:-}" ]] && grep -qw amx_int8 /proc/cpuinfo; then
    cmake_args+=" -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
fi
stamp="$venv/.llama-cpp-cmake-args"

have() {
    "$venv/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" \
        2>/dev/null && [[ "$(cat "$stamp" 2>/dev/null)" == "$cmake_args" ]]
}

if [[ -x "$venv/bin/python" ]] && have; then
    echo "llama.cpp peer venv $venv is ready (llama-cpp-python $version)"
else
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --upgrade --quiet pip
    echo "building llama-cpp-python $version (llama.cpp from source, CMAKE_ARGS=$cmake_args) ..."
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="$cmake_args" \
        "$venv/bin/python" -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
        "llama-cpp-python==$version"
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="$cmake_args" \
        "$venv/bin/python" -m pip install --quiet --no-cache-dir "llama-cpp-python[server]==$version"
    echo "$cmake_args" > "$stamp"
    have
fi
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, \
'system info:', llama_cpp.llama_print_system_info().decode().strip())"
