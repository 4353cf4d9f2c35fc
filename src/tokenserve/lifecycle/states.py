"""A version's status as GetModelStatus reports it. Its state is `stats.VersionState`, the
one enum of version states (observability reads it too, and imports nothing from here)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenserve.stats import VersionState


@dataclass(frozen=True)
class VersionStatus:
    """What GetModelStatus reports for one version."""

    version: int
    state: VersionState
    error_code: str = "OK"
    """A gRPC status code name (TF Serving's `error::Code`), "OK" when nothing failed."""
    error_message: str = ""
