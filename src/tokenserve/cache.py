"""Where tokenserve keeps what it can rebuild: exports of the built-in model, XLA programs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """$XDG_CACHE_HOME/tokenserve/<parts> (default ~/.cache/tokenserve/<parts>)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root, "tokenserve", *parts)
