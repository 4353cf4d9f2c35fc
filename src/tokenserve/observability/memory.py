"""`tokenserve:memory_bytes{kind=...}`: where the process's memory goes, read at scrape time.

Kinds, per model version (model_name, model_version set):
  weights            the engine's copy of the weights, the one it serves from
  kv_cache           the engine's KV pool (or an LSTM's state slots)
  savedmodel_weights the TF Serving Session's copy (0 until a TF Serving request builds it)
and for the process (model labels empty):
  resident           VmRSS, all of it
  runtime_other      resident less the kinds above: the TF runtime and its thread pools,
                     XLA's compiled programs, Python and its libraries, activations
The engine's pieces are exact sizes of what it allocated; `resident` is what the kernel
counts. The same breakdown is logged once per version when its engine starts.
"""

from __future__ import annotations

import ctypes
import gc
import re
import threading
from collections.abc import Callable
from pathlib import Path

from tokenserve.stats import VersionState

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

NAME = "tokenserve:memory_bytes"


def resident_bytes() -> int:
    """This process's VmRSS in bytes (0 without /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def release_freed_memory() -> None:
    """Hands memory that was freed back to the OS (glibc's malloc_trim): loading weights
    reads each tensor into a temporary buffer, and glibc keeps freed buffers in its arenas,
    where they count as resident until reused. A no-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def freeze_python_heap() -> None:
    """Collects garbage once, then moves every object Python's cycle collector tracks into
    its permanent generation (`gc.freeze`), so later collections skip them.

    A loaded model leaves a few hundred thousand long-lived objects (traced step graphs,
    Keras layers, the web stack): a full collection walks all of them, 220 ms in process
    for GPT-2-small on a 2-core EPYC and about 400 ms in the server, and it runs whenever
    enough new objects have survived, which start-up leaves due for the first request (its
    TTFT was 600-700 ms against 150-200 after it). vLLM freezes its heap after start-up for
    the same reason. Objects stay freed by reference counting; only cycles among frozen
    objects wait for `thaw_python_heap`."""
    gc.collect()
    gc.freeze()


def thaw_python_heap() -> None:
    """Returns frozen objects to the collector (an unloaded version's cycles among them);
    the next `freeze_python_heap` collects them."""
    gc.unfreeze()


_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")
_MADV_DONTNEED = 4


def release_file_pages() -> int:
    """Unmaps the pages of shared libraries that start-up touched and serving does not use.

    Importing TensorFlow and loading a model run code once (op and kernel registration,
    static initializers, Python bindings, graph building): about 390 MB of file-backed
    pages, mostly of libtensorflow_cc.so, stay mapped and count in VmRSS although a
    serving step touches about 60 MB of them. `madvise(MADV_DONTNEED)` drops this
    process's page-table entries of read-only, private file mappings with no page of
    their own (no copy-on-write page, so nothing is lost); the pages stay in the page
    cache, and one that is used again comes back on its first access (a minor fault).

    It frees no memory the kernel could not already reclaim: file pages are clean and
    reclaimable either way. It makes RSS say what the process uses. Anonymous memory is
    untouched.

    Returns:
        The bytes of resident file pages unmapped (0 without /proc or off Linux).
    """
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released, mapping, sizes = 0, None, {}

    def release() -> int:
        if mapping is None or sizes.get("Rss", 0) == 0 or sizes.get("Anonymous", 1) != 0:
            return 0
        if sizes.get("Locked", 0) != 0:
            return 0
        start, end = mapping
        return sizes["Rss"] * 1024 if madvise(start, end - start, _MADV_DONTNEED) == 0 else 0

    for line in lines:
        match = _MAPPING.match(line)
        if match is None:
            name, _, value = line.partition(":")
            if mapping is not None and value.strip().endswith("kB"):
                sizes[name] = int(value.split()[0])
            continue
        released += release()
        start, end, perms, path = match.groups()
        # read-only (no w), private (p), backed by a file on disk
        readonly_file = "w" not in perms and perms[3] == "p" and path.startswith("/")
        mapping = (int(start, 16), int(end, 16)) if readonly_file else None
        sizes = {}
    return released + release()


def _mib(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB"


def describe(parts: dict[str, int], resident: int) -> str:
    """One log line: resident memory and its parts."""
    known = sum(parts.values())
    pieces = ", ".join(f"{kind} {_mib(size)}" for kind, size in parts.items())
    return (f"memory: resident {_mib(resident)} = {pieces}, runtime and other "
            f"{_mib(max(resident - known, 0))}")


class MemoryGauges:
    """Registers the gauges on `registry`; versions add a source with `watch`."""

    def __init__(self, registry: CollectorRegistry):
        self._sources: dict[tuple[str, str], Callable[[], dict[str, int]]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def watch(self, model_name: str, version: str, read: Callable[[], dict[str, int]]) -> None:
        """`read()` -> {kind: bytes} for one version, called at every scrape."""
        with self._lock:
            self._sources[(model_name, version)] = read

    def forget(self, model_name: str, version: str) -> None:
        with self._lock:
            self._sources.pop((model_name, version), None)

    # a lifecycle observer (ModelManager.add_observer): a version's series go with it
    def on_version_state(self, model_name: str, version: int, state) -> None:
        if getattr(state, "name", state) == VersionState.END.name:
            self.forget(model_name, str(version))

    def on_load(self, *args) -> None:
        pass

    def on_warmup(self, *args) -> None:
        pass

    def snapshot(self) -> tuple[dict[tuple[str, str], dict[str, int]], int]:
        with self._lock:
            sources = list(self._sources.items())
        return {labels: read() for labels, read in sources}, resident_bytes()

    def collect(self):
        family = GaugeMetricFamily(NAME, "Bytes of memory by what holds them (kind); "
                                   "process-wide kinds have empty model labels.",
                                   labels=["kind", "model_name", "model_version"])
        versions, resident = self.snapshot()
        known = 0
        for (model, version), parts in versions.items():
            for kind, size in parts.items():
                family.add_metric([kind, model, version], size)
                known += size
        family.add_metric(["resident", "", ""], resident)
        family.add_metric(["runtime_other", "", ""], max(resident - known, 0))
        yield family
