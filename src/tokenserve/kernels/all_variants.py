"""Building every op library for every ISA variant: `python -m tokenserve.kernels.build
--all-variants`, what an image's build stage runs so the image needs no g++ and runs at each
CPU's level (variants.py says which levels, prebuilt.py where the files go and which one a
CPU loads).

g++ builds every variant of its own architecture whatever CPU it runs on; only loading a
variant needs a CPU that runs it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tokenserve.kernels.compiler import KernelBuildError
from tokenserve.kernels.prebuilt import build_variant
from tokenserve.kernels.variants import Variant


@dataclass(frozen=True)
class VariantBuild:
    """One library built as one variant: its file, or why it failed.

    Args:
        library: the library's name.
        variant: the variant it was built as.
        path: the .so written (or found already built), None when the build failed.
        error: the first error line of a failed build, else None.
        seconds: how long it took (0 for one already built).
    """

    library: str
    variant: Variant
    path: Path | None
    error: str | None
    seconds: float


def build_all_variants(libraries: Mapping[str, Sequence[Path]], variants: Sequence[Variant],
                       out_dir: Path) -> list[VariantBuild]:
    """Builds each of `libraries` (name -> sources) as each of `variants` into `out_dir`.

    Every (library, variant) pair builds at once; compiler.py keeps the g++ processes to one
    per CPU. A failed pair does not stop the others.

    Returns:
        One VariantBuild per pair, in `libraries` order, then `variants` order.
    """
    pairs = [(name, variant) for name in libraries for variant in variants]

    def build(pair: tuple[str, Variant]) -> VariantBuild:
        name, variant = pair
        start = time.perf_counter()
        try:
            path = build_variant(name, libraries[name], variant, out_dir)
        except (KernelBuildError, OSError) as e:  # OSError: g++ could not be started
            return VariantBuild(name, variant, None, (str(e).splitlines() or ["?"])[0],
                                time.perf_counter() - start)
        return VariantBuild(name, variant, path, None, time.perf_counter() - start)

    with ThreadPoolExecutor(max(1, len(pairs))) as pool:
        return list(pool.map(build, pairs))


def format_builds(builds: Sequence[VariantBuild]) -> str:
    """A table: library, variant, seconds, file or error."""
    rows = [("library", "variant", "seconds", "file")]
    rows += [(b.library, b.variant.name, f"{b.seconds:.1f}",
              str(b.path) if b.path else f"FAILED: {b.error}") for b in builds]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}"
                     for r in rows)
