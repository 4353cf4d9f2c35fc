"""Weights on 2 MiB pages: a decode step streams every weight once, and on
4 KiB pages that is one TLB miss per 4 KiB read.

Linux backs anonymous memory with 4 KiB pages unless told otherwise. Where transparent huge
pages are in `madvise` mode (Debian's and many distributions' default), memory gets 2 MiB
pages only where a process asks for them with `madvise(MADV_HUGEPAGE)`, and that applies
to pages faulted in later: the weights are already in memory by then. `MADV_COLLAPSE`
(Linux 6.1) rebuilds an already populated range as 2 MiB pages at once, in the calling
thread, independently of the sysfs THP settings (only "never" refuses it). This module does
both for the address ranges it is given, rounded out to 2 MiB boundaries and clipped to the
anonymous mappings that hold them, so nothing outside the process's own heap is touched.

It moves no data the process can see: virtual addresses and contents stay the same, and
the kernel copies the pages under its own locks. Memory grows by at most the untouched
4 KiB pages inside the rounded ranges (up to 2 MiB per range end); the weights' own pages are
all resident already.

Measured on a 2-core AMD EPYC (Zen 2, AVX2 only, THP in madvise mode): a two-thread AVX2
read of a 124 MiB buffer ran at a median 24.3 GB/s on 4 KiB pages and 26.9 GB/s on 2 MiB
pages (8 alternating runs each). GPT-2-small with int8 weights, one sequence, in-process:
9.7-10.6 ms a token on 4 KiB pages against 8.4-9.9 with weights and cache collapsed
(alternating processes, docs/performance.md). Float32 GPT-2 did not change (its fused ops
are not bound by the page walks).

What the kernel refuses (no THP support, THP "never", an older kernel without
MADV_COLLAPSE) is reported, not raised: serving works the same on 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import errno
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$")


@dataclass(frozen=True)
class HugePageReport:
    """What `back_with_huge_pages` did: the bytes it was asked for, the 2 MiB-rounded bytes
    it advised, the growth of this process's AnonHugePages over the call, and why it did
    less than asked (None: it did all of it)."""
    requested_bytes: int
    advised_bytes: int
    huge_bytes: int
    reason: str | None = None

    def describe(self) -> str:
        text = (f"{self.huge_bytes / 2**20:,.0f} MiB of {self.requested_bytes / 2**20:,.0f} MiB "
                f"now on 2 MiB pages")
        return f"{text} ({self.reason})" if self.reason else text


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or None
    where it has none (not Linux, or built without THP)."""
    try:
        match = re.search(r"\[(\w+)\]", _THP_ENABLED.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def anon_huge_bytes() -> int:
    """This process's anonymous memory on huge pages (AnonHugePages), in bytes; 0 without
    /proc."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _anonymous_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private, writable mappings with no file behind them
    (the heap and malloc's mmap'd chunks), sorted."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        match = _MAPPING.match(line)
        if match is None:
            continue
        start, end, perms, inode, path = match.groups()
        if perms.startswith("rw") and perms[3] == "p" and inode == "0" and (
                not path or path == "[heap]"):
            spans.append((int(start, 16), int(end, 16)))
    return sorted(spans)


def huge_page_spans(ranges: Iterable[tuple[int, int]],
                    mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned spans covering `ranges` ([start, end) addresses), merged where they
    touch, each clipped to the aligned part of the anonymous mapping holding it; ranges
    outside every mapping are dropped."""
    pages = set()
    for start, end in ranges:
        if end > start:
            pages.update(range(start - start % HUGE_PAGE, end, HUGE_PAGE))
    spans: list[list[int]] = []
    for page in sorted(pages):
        for low, high in mappings:
            low, high = -(-low // HUGE_PAGE) * HUGE_PAGE, high - high % HUGE_PAGE
            if low <= page and page + HUGE_PAGE <= high:
                if spans and spans[-1][1] == page:
                    spans[-1][1] = page + HUGE_PAGE
                else:
                    spans.append([page, page + HUGE_PAGE])
                break
    return [(start, end) for start, end in spans]


def back_with_huge_pages(ranges: Iterable[tuple[int, int]]) -> HugePageReport:
    """Advises 2 MiB pages for these address ranges ([start, end), bytes this process has
    allocated and filled) and collapses them onto 2 MiB pages now.

    Safe to call while other threads read the memory; never raises for what the kernel
    refuses (see HugePageReport.reason).
    """
    ranges = [(int(start), int(end)) for start, end in ranges]
    requested = sum(end - start for start, end in ranges)
    if not sys.platform.startswith("linux"):
        return HugePageReport(requested, 0, 0, "not Linux")
    mode = thp_mode()
    if mode is None or mode == "never":
        return HugePageReport(requested, 0, 0, "transparent huge pages are "
                              + ("off (never)" if mode else "not in this kernel"))
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        spans = huge_page_spans(ranges, _anonymous_mappings())
    except (OSError, AttributeError) as e:
        return HugePageReport(requested, 0, 0, f"no madvise or /proc/self/maps: {e}")
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    before = anon_huge_bytes()
    refused = set()
    for start, end in spans:
        for advice in (_MADV_HUGEPAGE, _MADV_COLLAPSE):
            if madvise(start, end - start, advice) != 0:
                # EINVAL: a kernel before 6.1 has no MADV_COLLAPSE (khugepaged still
                # collapses the advised range later, at its own pace); EAGAIN/ENOMEM: no
                # free 2 MiB page for some of the range right now
                refused.add(errno.errorcode.get(ctypes.get_errno(), "?"))
    advised = sum(end - start for start, end in spans)
    reason = None
    if refused:
        reason = "the kernel refused part of it: " + ", ".join(sorted(refused))
    elif advised < requested:
        reason = "what lies in no 2 MiB page of its mapping stays on 4 KiB pages"
    return HugePageReport(requested, advised, max(0, anon_huge_bytes() - before), reason)

