"""The output directory of a command that writes one (export, optimize, prune, train)."""

from __future__ import annotations

from pathlib import Path

from tokenserve.errors import ConfigError


def prepare_output_dir(path) -> Path:
    """Creates `path` (and its parents) if it is missing, before any slow work, and refuses
    one that cannot be a writable directory (a file, under a file, no permission) with a
    ConfigError naming the reason, where the first write used to end in a traceback."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"the output path {path} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the output directory {path}: "
                          f"{error.strerror or error}") from None
    probe = path / ".tokenserve-write-check"
    try:
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"cannot write in the output directory {path}: "
                          f"{error.strerror or error}") from None
    return path
