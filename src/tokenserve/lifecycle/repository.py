"""A model's base path in TF Serving's layout: `<base_path>/<version>/`."""

from __future__ import annotations

import os
from pathlib import Path

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
TFLITE_FILE = "model.tflite"


def discover_versions(base_path: str | Path) -> dict[int, Path]:
    """Numbered version directories under base_path (hidden and non-numeric names skipped).

    A missing base path is no versions, not an error: TF Serving keeps polling it.
    """
    base = Path(base_path)
    try:
        entries = list(os.scandir(base))
    except OSError:
        return {}
    versions = {}
    for entry in entries:
        if entry.name.isdigit() and entry.is_dir():
            versions[int(entry.name)] = Path(entry.path)
    return versions


def fingerprint(version_dir: Path) -> tuple:
    """Names, sizes and mtimes of a version's files: changes when a copy completes.

    A version that failed to load is retried when this changes (a half-copied directory
    finishing its copy), and not retried while it stays the same.
    """
    items = []
    for root, _, files in os.walk(version_dir):
        for name in files:
            try:
                stat = os.stat(os.path.join(root, name))
            except OSError:
                continue
            items.append((os.path.relpath(os.path.join(root, name), version_dir),
                          stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(items))
