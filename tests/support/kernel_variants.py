"""Running kernel_variant_probe.py in a fresh process (no g++ on its PATH, the environment
choosing the variant) and checking its report: shared by the kernel-variant tests and the
image's build-stage test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tokenserve.host.cpu_flags import cpu_flag_set
from tokenserve.kernels import build
from tokenserve.kernels.prebuilt import PREBUILT_ENV
from tokenserve.kernels.variants import ISA_ENV

PROBE = Path(__file__).parent / "kernel_variant_probe.py"
# what would make a process load another file than the one a test sets up
OTHER_CHOICES = (PREBUILT_ENV, ISA_ENV, build.MARCH_ENV, build.KERNELS_ENV,
                 *(name for library in build.LIBRARIES.values()
                   for name in (library.mode_env, library.march_env) if name))


def probe(no_tools: Path, env: dict[str, str], *args: str) -> dict:
    """kernel_variant_probe.py's report, run with `env` over ours minus OTHER_CHOICES and
    PATH set to `no_tools` (an empty folder: no g++)."""
    no_tools.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in OTHER_CHOICES}
    result = subprocess.run([sys.executable, str(PROBE), *args],
                            env={**base, "PATH": str(no_tools), "TF_CPP_MIN_LOG_LEVEL": "3",
                                 **env},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_report(report: dict, name: str) -> None:
    """The variant `name` was loaded and its int8 kernels give the reference's numbers."""
    assert report.get("variant") == name, report
    assert f"variant {name} (" in report["status"]
    errors = report["errors"]
    assert errors["auto/float"] < 1e-5 and errors["scalar/float"] < 1e-5, errors
    # int8 activations: up to 1/254 of a block's absmax a value (see test_int8_kernel.py)
    assert max(errors["auto/int8"], errors["scalar/int8"], errors["auto/int8/tile"]) < 3e-2
    flags = cpu_flag_set()
    if "avx512_vnni" in flags:  # the cap really chose: only x86-64-v4-vnni has VNNI code
        assert ("VNNI" in report["isa"]) == (name == "x86-64-v4-vnni"), report["isa"]
    elif "avx2" in flags and "fma" in flags:
        assert report["isa"].startswith("AVX2"), report["isa"]
