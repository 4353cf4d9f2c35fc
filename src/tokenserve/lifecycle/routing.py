"""The read side of ModelManager: routing requests to AVAILABLE versions and reporting what
every version is doing (GetModelStatus, the OpenAI model list).

Everything here reads the manager's tables under its lock and changes nothing but the
in-flight counts that `acquire` holds; ModelManager (manager.py) changes the tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokenserve.errors import InvalidRequestError, ModelNotFoundError
from tokenserve.lifecycle.states import VersionStatus
from tokenserve.lifecycle.version import LoadedVersion
from tokenserve.stats import VersionState


class VersionRouting:
    """Mixed into ModelManager, whose `_cond`, `_specs`, `_versions`, `_outgoing` and
    `_labels` it reads."""

    @contextmanager
    def acquire(self, model_name: str, version: int | None = None,
                label: str | None = None) -> Iterator[LoadedVersion]:
        """Holds an AVAILABLE version for the duration of the `with` block.

        The version cannot finish unloading while held, so a request (or a generation
        stream) that started on it completes on it. Raises ModelNotFoundError with TF
        Serving's message when nothing matches, InvalidRequestError for an unknown label.
        """
        with self._cond:
            found = self._resolve(model_name, version, label)
            found.num_inflight += 1
        try:
            yield found
        finally:
            with self._cond:
                found.num_inflight -= 1
                if found.num_inflight == 0:
                    self._cond.notify_all()

    def _serving(self, name: str) -> dict[int, LoadedVersion]:
        """The versions requests to `name` may reach: its config's, and while a reload is
        loading, the AVAILABLE ones it held (the config's win where both are AVAILABLE)."""
        current = self._versions.get(name, {}) if name in self._specs else {}
        held = self._outgoing.get(name)
        if not held:
            return current
        merged = dict(held)
        for number, version in current.items():
            if version.state == VersionState.AVAILABLE or number not in merged:
                merged[number] = version
        return merged

    def _resolve(self, name: str, version: int | None, label: str | None) -> LoadedVersion:
        if label:
            if name not in self._specs and name not in self._outgoing:
                raise ModelNotFoundError(f"Servable not found for request: Latest({name})")
            if label not in self._labels.get(name, {}):
                raise InvalidRequestError(f"Unrecognized servable version label: {label}")
            version = self._labels[name][label]
        versions = self._serving(name)
        if version is not None:
            found = versions.get(int(version))
            if found is None or found.state != VersionState.AVAILABLE:
                raise ModelNotFoundError(
                    f"Servable not found for request: Specific({name}, {version})")
            return found
        available = [v for v in versions.values() if v.state == VersionState.AVAILABLE]
        if not available:
            raise ModelNotFoundError(f"Servable not found for request: Latest({name})")
        return max(available, key=lambda v: v.version)

    def model_names(self) -> list[str]:
        """Names of the configured models (and of those a pending reload still serves)."""
        with self._cond:
            return sorted(set(self._specs) | set(self._outgoing))

    def available_versions(self, model_name: str) -> list[LoadedVersion]:
        """AVAILABLE versions of a model, highest first (empty for an unknown model)."""
        with self._cond:
            return sorted((v for v in self._serving(model_name).values()
                           if v.state == VersionState.AVAILABLE),
                          key=lambda v: -v.version)

    def labels(self, model_name: str) -> dict[str, int]:
        """Label -> version for a model (labels may name versions that are not AVAILABLE)."""
        with self._cond:
            return dict(self._labels.get(model_name, {}))

    def model_status(self, model_name: str, version: int | None = None) -> list[VersionStatus]:
        """GetModelStatus: every known version of a model, or one version, highest first."""
        with self._cond:
            versions = dict(self._outgoing.get(model_name, {}))
            versions.update(self._versions.get(model_name, {}))
            if not versions:
                raise ModelNotFoundError(f"Could not find any versions of model {model_name}")
            if version is not None:
                if version not in versions:
                    raise ModelNotFoundError(
                        f"Could not find version {version} of model {model_name}")
                return [versions[version].status]
            return [versions[n].status for n in sorted(versions, reverse=True)]

    def wait_until_settled(self, timeout_s: float | None = None) -> bool:
        """Blocks until no version is START or LOADING; False on timeout."""
        def settled():
            return all(v.state not in (VersionState.START, VersionState.LOADING)
                       for versions in self._versions.values() for v in versions.values())
        with self._cond:
            return self._cond.wait_for(settled, timeout=timeout_s)
