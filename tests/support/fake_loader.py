"""A loader double for the lifecycle's ModelManager (no TensorFlow), and helpers to lay out
version directories and read the manager's states."""

from __future__ import annotations

import threading
from pathlib import Path

from tokenserve.errors import ModelLoadError


class FakeServable:
    def __init__(self, path: Path):
        self.path = path
        self.closed = False
        self.signature_defs = {}

    def close(self):
        self.closed = True


class FakeLoader:
    """Loads any directory without a FAIL file; `gate` (if set) holds loads until set."""

    def __init__(self):
        self.gate: threading.Event | None = None
        self.calls: list[Path] = []

    def __call__(self, spec, path: Path):
        self.calls.append(path)
        if self.gate is not None:
            assert self.gate.wait(10)
        if (path / "FAIL").exists():
            failure = ModelLoadError(f"cannot load {path}")
            failure.error_code = "NOT_FOUND"
            raise failure
        return FakeServable(path)


def make_version(base: Path, version: int, fail: bool = False) -> Path:
    """An empty version directory `base/version` (that FakeLoader fails to load if `fail`)."""
    path = base / str(version)
    path.mkdir(parents=True)
    if fail:
        (path / "FAIL").write_text("x")
    return path


def states(manager, name):
    """{version: state} of model `name`."""
    return {s.version: s.state for s in manager.model_status(name)}
