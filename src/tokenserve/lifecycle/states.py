"""Version states, numbered as TF Serving's `ModelVersionStatus.State`."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class VersionState(enum.IntEnum):
    """Lifecycle of one model version; values equal get_model_status.proto's enum."""

    START = 10
    LOADING = 20
    AVAILABLE = 30
    UNLOADING = 40
    END = 50


@dataclass(frozen=True)
class VersionStatus:
    """What GetModelStatus reports for one version."""

    version: int
    state: VersionState
    error_code: str = "OK"
    """A gRPC status code name (TF Serving's `error::Code`), "OK" when nothing failed."""
    error_message: str = ""
