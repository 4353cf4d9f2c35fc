"""Streamed text that may end in the start of a marker (a tool-call tag, the end of the
reasoning): how much of it to hold back until the next delta shows whether the marker
follows."""

from __future__ import annotations


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that `marker` begins with (0: none)."""
    return next((k for k in range(min(len(marker), len(text)), 0, -1)
                 if marker.startswith(text[-k:])), 0)
