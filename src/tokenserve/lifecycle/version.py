"""One version of one model, as the manager tracks it from START to END."""

from __future__ import annotations

from pathlib import Path

from tokenserve.lifecycle.states import VersionStatus
from tokenserve.stats import VersionState


class LoadedVersion:
    """One version of one model, from START to END.

    `servable` runs signatures; `extensions` holds what registered extension factories built
    for it (e.g. `extensions["engine"]`). Read-only for callers: the manager changes state.
    """

    def __init__(self, model_name: str, version: int, path: Path):
        self.model_name = model_name
        self.version = version
        self.path = path
        self.state = VersionState.START
        self.error_code = "OK"
        self.error_message = ""
        self.servable = None
        self.extensions: dict[str, object] = {}
        self.num_inflight = 0
        self.fingerprint: tuple | None = None
        self.loaded_at: float | None = None
        """Unix time the version became AVAILABLE (OpenAI's `created`)."""

    @property
    def failed(self) -> bool:
        return self.error_code != "OK"

    @property
    def status(self) -> VersionStatus:
        return VersionStatus(self.version, self.state, self.error_code, self.error_message)

    def __repr__(self) -> str:
        return f"LoadedVersion({self.model_name!r}, {self.version}, {self.state.name})"
