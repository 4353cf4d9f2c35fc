"""The user cache directory: where tokenserve keeps what it can rebuild (exports of the
built-in and packaged models, XLA programs, compiled kernels). Not the KV cache, which is
the engine's (`engine/cache_accounting.py`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """$XDG_CACHE_HOME/tokenserve/<parts> (default ~/.cache/tokenserve/<parts>)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root, "tokenserve", *parts)
