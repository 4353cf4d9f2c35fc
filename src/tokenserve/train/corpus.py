"""The training corpus: the running interpreter's standard-library sources.

Every machine that runs tokenserve has it, so the built-in model can be
retrained anywhere with no download. Files are read in sorted order and the
held-out split is chosen by a hash of each file's relative path, so the split
is the same on every run.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Tests, IDLE and the 2to3 fixtures are large and unlike code people write.
_SKIPPED_PARTS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted, without tests and vendored code."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if not parts & _SKIPPED_PARTS:
            files.append(path)
    return files


def is_holdout(relative_path: str, fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") < fraction * 2**32


@dataclass
class Corpus:
    train_texts: list[str]
    holdout_texts: list[str]

    @classmethod
    def from_stdlib(cls, holdout_fraction: float, root: str | Path | None = None) -> "Corpus":
        root = Path(root or sysconfig.get_paths()["stdlib"])
        train, holdout = [], []
        for path in stdlib_files(root):
            text = path.read_text(encoding="utf-8", errors="replace")
            rel = path.relative_to(root).as_posix()
            (holdout if is_holdout(rel, holdout_fraction) else train).append(text)
        return cls(train, holdout)


def token_stream(texts: list[str], tokenizer) -> np.ndarray:
    """All texts as one int32 stream: bos, text, eos, bos, text, eos, ..."""
    pieces = []
    for ids in tokenizer.encode_batch(texts):
        pieces.append([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id])
    return np.fromiter((t for p in pieces for t in p), dtype=np.int32)
