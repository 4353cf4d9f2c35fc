"""Run as a script by the kernel-variant tests, in a fresh process whose environment picks the
variant (TOKENSERVE_KERNELS_ISA, TOKENSERVE_KERNELS_DIR, a PATH without g++): loads the int8
matmul op as serving would, runs a small case against a float64 reference, and prints one
JSON line: which file it loaded, its kernels' ISA, the errors; with --all, every library's
status too.

    python tests/support/kernel_variant_probe.py [--all]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tokenserve.kernels import build
from tokenserve.kernels import int8_matmul as im


def relative_error(y, reference) -> float:
    return float(np.abs(y - reference).max() / np.abs(reference).max())


def main() -> None:
    loaded = im.LIBRARY.load()
    if isinstance(loaded, str):
        print(json.dumps({"error": loaded}))
        return
    op, located = loaded
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 300)).astype(np.float32)  # 5 rows: the row kernel; K % 32 != 0
    q, scale = im.quantize_weight(rng.standard_normal((300, 37)).astype(np.float32))
    exact = x.astype(np.float64) @ im.dequantize_weight(q, scale).astype(np.float64).T
    errors = {}
    for isa in ("auto", "scalar"):
        for activations in ("float", "int8"):
            y = im.compiled_int8_matmul(x, q, scale, activations, isa).numpy()
            errors[f"{isa}/{activations}"] = relative_error(y, exact)
    big = rng.standard_normal((40, 256)).astype(np.float32)  # 40 rows: the tile kernel
    wide_q, wide_scale = im.quantize_weight(rng.standard_normal((256, 24)).astype(np.float32))
    wide = big.astype(np.float64) @ im.dequantize_weight(wide_q, wide_scale).T
    errors["auto/int8/tile"] = relative_error(im.int8_matmul(big, wide_q, wide_scale).numpy(),
                                              wide)
    report = {"variant": located.variant.name if located.variant else None,
              "path": str(located.path), "isa": op.tokenserve_int8_matmul_info().numpy().decode(),
              "status": im.LIBRARY.status(), "errors": errors}
    if "--all" in sys.argv[1:]:
        report["statuses"] = {name: library.status() for name, library in build.LIBRARIES.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
