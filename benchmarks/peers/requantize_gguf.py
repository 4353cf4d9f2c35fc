#!/usr/bin/env python
"""Requantizes a GGUF file with llama.cpp's own quantizer (`llama_model_quantize`, as the
`llama-quantize` tool calls it), so a benchmark can name a file of a type no installed
package ships, e.g. a Q4_0 SmolLM2 made from its Q4_1 file. llama.cpp picks the per-tensor
types of the chosen file type as `llama-quantize` does (the output or tied embedding stays
at a higher precision). Requantizing a 4-bit file costs quality, not speed: the file is for
speed and memory figures only.

Runs in the llama.cpp peer's venv (bash benchmarks/peers/setup_llama_cpp.sh):

    benchmarks/.venv-llama-cpp/bin/python benchmarks/peers/requantize_gguf.py SRC DST \\
        [--type q4_0]
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

# llama.h's enum llama_ftype: the file types this script offers
FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("destination", type=Path)
    parser.add_argument("--type", choices=sorted(FILE_TYPES), default="q4_0")
    args = parser.parse_args(argv)
    import llama_cpp  # the peer venv's; after --help

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[args.type]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    partial = args.destination.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(args.source).encode(), str(partial).encode(),
                                            ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed with status {status}")
    partial.rename(args.destination)  # a file at DST is whole
    print(f"wrote {args.destination} ({args.type}, {args.destination.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
