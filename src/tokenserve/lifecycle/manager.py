"""Owns every model's versions: aspires, loads, warms, routes, drains and unloads them.

Availability-preserving, as TF Serving's default policy: a new version loads, warms up and
runs its extensions before any version it replaces starts UNLOADING, and a version leaves
UNLOADING only when its in-flight count (held through `acquire()`) reaches zero. A version
that fails to load is retried, then reported as END with its error; the versions it would
have replaced keep serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tokenserve.errors import ConfigError, FailedPreconditionError, ModelLoadError
from tokenserve.lifecycle.model_config import ModelSpecConfig
from tokenserve.lifecycle.repository import discover_versions, fingerprint
from tokenserve.lifecycle.routing import VersionRouting
from tokenserve.lifecycle.version import LoadedVersion
from tokenserve.lifecycle.version_loading import Extension, Loader, VersionLoading
from tokenserve.stats import VersionState

log = logging.getLogger("tokenserve.lifecycle")


class ModelManager(VersionRouting):
    """Versions of every configured model, with TF Serving's lifecycle.

    Args:
        loader: builds a servable from a version directory (see lifecycle.servable_loader).
        warmup: replays warmup records against a loaded version, or None to skip warmup.
        max_num_load_retries: retries after a failed load (TF Serving's default 5).
        load_retry_interval_s: wait between retries (TF Serving's default 60 s).
        allow_labels_for_unavailable: let a config label a version that is not AVAILABLE.
        metrics: optional object with `load(model_path, seconds, ok)` and
            `warmup(model_path, seconds)`.
        unload_drain_timeout_s: how long an unloading version waits for its in-flight
            requests before it is torn down anyway (None: forever).

    Example:
        >>> manager = ModelManager(loader)
        >>> manager.register_extension("engine", lambda version: Engine(version.path))
        >>> manager.apply_config([ModelSpecConfig("m", "/models/m")])
        >>> with manager.acquire("m", label="stable") as version:
        ...     version.servable.run("serving_default", {"x": x})
    """

    def __init__(self, loader: Loader, *, warmup: Callable[[LoadedVersion], None] | None = None,
                 max_num_load_retries: int = 5, load_retry_interval_s: float = 60.0,
                 allow_labels_for_unavailable: bool = False, metrics=None,
                 unload_drain_timeout_s: float | None = 900.0):
        self._loading = VersionLoading(loader, warmup, metrics, self._notify)
        self._max_num_load_retries = max_num_load_retries
        self._load_retry_interval_s = load_retry_interval_s
        self._allow_labels_for_unavailable = allow_labels_for_unavailable
        # Longer than any request may run (600 s by default), so only a hold that leaked
        # reaches it; then the version unloads anyway rather than never.
        self._unload_drain_timeout_s = unload_drain_timeout_s
        self._observers: list = []
        self._cond = threading.Condition(threading.RLock())
        self._stopping = threading.Event()
        self._specs: dict[str, ModelSpecConfig] = {}
        self._labels: dict[str, dict[str, int]] = {}
        # A reload keeps the versions it replaces serving (_outgoing, by model) until every
        # model it added or moved (_awaited) has an AVAILABLE version; see _finish_reload.
        self._outgoing: dict[str, dict[int, LoadedVersion]] = {}
        self._awaited: set[str] = set()
        self._versions: dict[str, dict[int, LoadedVersion]] = {}
        self._discovered: dict[str, dict[int, Path]] = {}
        self._reported_empty: dict[str, str] = {}  # model -> why it has no versions, logged
        self._extensions: list[tuple[str, Extension]] = []
        self._threads: list[threading.Thread] = []

    # ---- configuration -------------------------------------------------------------------

    def register_extension(self, name: str, factory: Extension) -> None:
        """Runs `factory(version)` for every version after warmup, before it is AVAILABLE.

        A non-None result is kept as `version.extensions[name]` and its `close()` (or
        `shutdown()`), if any, is called when the version unloads, after its in-flight
        requests drained. A factory that
        raises fails the load like a corrupt model would. Register before `apply_config`.
        """
        with self._cond:
            self._extensions.append((name, factory))

    def add_observer(self, observer) -> None:
        """`observer.on_version_state(model, version, state)` on every state change,
        `observer.on_load(model, version, seconds, ok)` after each load attempt and
        `observer.on_warmup(model, version, seconds)` after each warmup. Called with the
        manager's lock held for state changes: keep them quick, never call back in."""
        with self._cond:
            self._observers.append(observer)

    def _notify(self, event: str, version: LoadedVersion, *args) -> None:
        for observer in list(self._observers):
            try:
                getattr(observer, event)(version.model_name, version.version, *args)
            except Exception:  # noqa: BLE001 - observers never break the lifecycle
                log.exception("observer %r failed on %s", observer, event)

    def _set_state(self, version: LoadedVersion, state: VersionState) -> None:
        version.state = state
        self._notify("on_version_state", version, state)

    def apply_config(self, specs: list[ModelSpecConfig], wait: bool = True,
                     timeout_s: float | None = None) -> None:
        """Full replacement: serve exactly `specs` (models left out are unloaded).

        Labels must name AVAILABLE versions unless allow_labels_for_unavailable. On a reload
        they are checked first, as TF Serving does, and a config that fails the check is
        refused whole (FailedPreconditionError; nothing changes). The first config is
        checked after its versions load, so a server can start with labels. With `wait`,
        returns when every new version has loaded or failed.

        A reload never takes serving down before its replacement serves: models it removes,
        and the old versions of models it moves to another base path, keep serving until
        every model it adds or moves has an AVAILABLE version (then they unload). With
        `wait`, a reload whose new models did not become available (no base path, no
        version directory, or every load failed) raises ModelLoadError naming them and why;
        the old versions keep serving until the new ones load on a later poll.
        """
        names = [spec.name for spec in specs]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise ConfigError(f"Illegal to list model {name} multiple times in config list")
        with self._cond:
            initial = not self._specs and not self._versions
            if not initial:
                self._check_labels(specs)
            new_specs = {spec.name: spec for spec in specs}
            for name, spec in new_specs.items():  # back in the config before it was retired
                held = self._outgoing.get(name, {})
                if (held and name not in self._specs
                        and all(v.path.parent == Path(spec.base_path) for v in held.values())):
                    self._versions.setdefault(name, {}).update(self._outgoing.pop(name))
            for name, old in self._specs.items():
                if name not in new_specs:
                    self._hold(name, moved=False)
                elif old.base_path != new_specs[name].base_path:
                    self._hold(name, moved=True)
            added = set() if initial else {
                name for name, spec in new_specs.items()
                if name not in self._specs or self._specs[name].base_path != spec.base_path}
            self._awaited |= added
            self._specs = new_specs
            for name in list(self._labels):
                if name not in self._specs and name not in self._outgoing:
                    del self._labels[name]
        self.poll()
        if wait:
            self.wait_until_settled(timeout_s=timeout_s)
        self._finish_reload()
        with self._cond:
            if initial:
                self._check_labels(specs)
            for spec in specs:
                self._labels[spec.name] = dict(spec.labels)
            unavailable = sorted(name for name in added
                                 if name in self._specs and not self._has_available(name))
            reasons = [self._why_unavailable(name) for name in unavailable]
        if wait and unavailable:
            raise ModelLoadError(f"{len(unavailable)} model(s) did not become available: "
                                 f"{{{', '.join(reasons)}}}; the models this config replaces "
                                 f"keep serving until they do")

    def _hold(self, name: str, moved: bool) -> None:
        """A reload removes `name`, or moves it to another base path (whose versions are
        other servables): its AVAILABLE versions keep serving, outside the config, until
        _finish_reload retires them. The rest go as before: a moved model's versions still
        loading are dropped, a removed model's unload and stay in its status."""
        versions = self._versions.get(name, {})
        held = {number: version for number, version in versions.items()
                if version.state == VersionState.AVAILABLE}
        if moved:
            self._versions.pop(name, None)
            self._discovered.pop(name, None)
        else:
            for number in held:
                del versions[number]
        if held:
            self._outgoing.setdefault(name, {}).update(held)

    def _has_available(self, name: str) -> bool:
        return any(version.state == VersionState.AVAILABLE
                   for version in self._versions.get(name, {}).values())

    def _why_unavailable(self, name: str) -> str:
        """TF Serving's words for a model without an AVAILABLE version."""
        base = self._specs[name].base_path
        versions = self._versions.get(name, {})
        failed = [v for v in versions.values() if v.failed]
        if failed:
            return ", ".join(f"{{name: {name} version: {v.version}}} due to error: "
                             f"{v.error_message}" for v in failed)
        if versions:
            return f"{{name: {name}}} is still loading"
        if not Path(base).is_dir():
            return f"{{name: {name}}} Could not find base path {base} for servable {name}"
        return (f"{{name: {name}}} No versions of servable {name} found under base path "
                f"{base}. Did you forget to name your leaf directory as a number (eg. '/1/')?")

    def _finish_reload(self) -> None:
        """Retires the versions held by reloads once every awaited model serves."""
        with self._cond:
            self._awaited = {name for name in self._awaited if name in self._specs}
            if not self._outgoing:
                self._awaited = set()  # nothing waits on them
                return
            if not all(map(self._has_available, self._awaited)):
                return
            outgoing, self._outgoing, self._awaited = self._outgoing, {}, set()
            removed = []
            for name, held in outgoing.items():
                if name in self._specs:  # moved: the old path's versions unload
                    for version in held.values():
                        if version.state == VersionState.AVAILABLE:
                            self._set_state(version, VersionState.UNLOADING)
                            self._start(self._unload, version)
                else:  # removed: unload as any version no longer aspired, status kept
                    self._versions.setdefault(name, {}).update(held)
                    self._labels.pop(name, None)
                    removed.append(name)
        for name in removed:
            self._reconcile(name, {})

    def _check_labels(self, specs: list[ModelSpecConfig]) -> None:
        if self._allow_labels_for_unavailable:
            return
        for spec in specs:
            for label, number in spec.labels.items():
                found = self._versions.get(spec.name, {}).get(number)
                if found is None or found.state != VersionState.AVAILABLE:
                    raise FailedPreconditionError(
                        f"Request to assign label to version {number} of model {spec.name}, "
                        f"which is not currently available for inference")

    # ---- polling and reconciling ---------------------------------------------------------

    def poll(self) -> None:
        """Looks for version directories of every model and starts loads and unloads."""
        with self._cond:
            specs = dict(self._specs)
            removed = [name for name in self._versions if name not in specs]
        for name, spec in specs.items():
            self._reconcile(name, discover_versions(spec.base_path))
        for name in removed:
            self._reconcile(name, {})
        self._finish_reload()

    def _reconcile(self, name: str, discovered: dict[int, Path] | None = None) -> None:
        rescan = discovered is None
        with self._cond:
            if rescan:
                discovered = self._discovered.get(name, {})
            failed = [n for n, v in self._versions.get(name, {}).items()
                      if n in discovered and v.state == VersionState.END and v.failed]
        # Walking a directory takes a while: not under the lock every acquire() needs.
        prints = {n: fingerprint(discovered[n]) for n in failed}
        with self._cond:
            if rescan:  # what the last poll found, not what it found before a reload moved it
                discovered = self._discovered.get(name, {})
            self._discovered[name] = discovered
            spec = self._specs.get(name)
            self._report_empty(name, spec, discovered)
            versions = self._versions.setdefault(name, {})
            aspired = spec.policy.select(list(discovered)) if spec else set()
            for number in sorted(aspired):
                current = versions.get(number)
                if current is None or self._should_reload(current, prints.get(number)):
                    version = LoadedVersion(name, number, discovered[number])
                    versions[number] = version
                    self._notify("on_version_state", version, version.state)
                    self._start(self._load, version, spec)
            pending = any(versions[n].state in (VersionState.START, VersionState.LOADING)
                          for n in aspired)
            available = any(versions[n].state == VersionState.AVAILABLE for n in aspired)
            if spec is None or not aspired or (available and not pending):
                for number, version in versions.items():
                    if number not in aspired and version.state == VersionState.AVAILABLE:
                        # no new acquire() from now
                        self._set_state(version, VersionState.UNLOADING)
                        self._start(self._unload, version)

    def _report_empty(self, name: str, spec, discovered: dict) -> None:
        """Logs (caller holds _cond) that a model's base path is missing or holds no version
        directory: once per reason, until versions appear. TF Serving logs it on every poll;
        a server started on a mistyped path used to say nothing while it waited."""
        if spec is None or discovered:
            self._reported_empty.pop(name, None)
            return
        base = spec.base_path
        if not Path(base).is_dir():
            why = f"{name}: could not find base path {base} (waiting for it to appear)"
        else:
            why = (f"{name}: no versions found under base path {base}. Did you forget to "
                   f"name your leaf directory as a number (eg. '/1/')?")
        if self._reported_empty.get(name) != why:
            self._reported_empty[name] = why
            log.warning("%s", why)

    @staticmethod
    def _should_reload(version: LoadedVersion, current_fingerprint: tuple | None) -> bool:
        if version.state != VersionState.END:
            return False
        # A cleanly unloaded version that is aspired again reloads; a failed one only when
        # its files changed (a half-copied directory that finished copying). A version that
        # failed since its fingerprint was taken has none yet: the next poll looks again.
        if not version.failed:
            return True
        return current_fingerprint is not None and current_fingerprint != version.fingerprint

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True,
                                  name=f"lifecycle-{target.__name__}")
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    # ---- load and unload (each in its own thread) ----------------------------------------

    def _load(self, version: LoadedVersion, spec: ModelSpecConfig) -> None:
        for attempt in range(self._max_num_load_retries + 1):
            files = fingerprint(version.path)  # a directory walk: not under the lock
            with self._cond:
                self._set_state(version, VersionState.LOADING)
                version.fingerprint = files
                self._cond.notify_all()
            with self._cond:
                extensions = list(self._extensions)
            try:
                self._loading.bring_up(version, spec, extensions)
            except Exception as error:  # noqa: BLE001 - any failure is reported in status
                self._loading.tear_down(version)
                log.warning("loading %s version %d failed (attempt %d): %s", version.model_name,
                            version.version, attempt + 1, error)
                last_error = error
                if attempt < self._max_num_load_retries and not self._stopping.wait(
                        self._load_retry_interval_s):
                    continue
                with self._cond:
                    version.error_code = getattr(last_error, "error_code", "UNKNOWN")
                    version.error_message = str(last_error)
                    self._set_state(version, VersionState.END)
                    self._cond.notify_all()
                self._reconcile(version.model_name)
                return
            break
        with self._cond:
            # Retired: its model moved to another base path while this version loaded.
            retired = self._versions.get(version.model_name, {}).get(version.version) is not version
            if not retired:
                version.loaded_at = time.time()
                self._set_state(version, VersionState.AVAILABLE)
                version.error_code, version.error_message = "OK", ""
                self._cond.notify_all()
        if retired:
            self._loading.tear_down(version)
            with self._cond:
                self._set_state(version, VersionState.END)
                self._cond.notify_all()
            return
        log.info("%s version %d is AVAILABLE", version.model_name, version.version)
        self._reconcile(version.model_name)
        self._finish_reload()

    def _unload(self, version: LoadedVersion) -> None:
        with self._cond:
            drained = self._cond.wait_for(lambda: version.num_inflight == 0,
                                          timeout=self._unload_drain_timeout_s)
        if not drained:
            log.warning("%s version %d still has %d requests in flight after %.0f s; "
                        "unloading it anyway", version.model_name, version.version,
                        version.num_inflight, self._unload_drain_timeout_s)
        try:
            self._loading.tear_down(version)
        finally:  # END whatever closing did, so the version is released
            with self._cond:
                self._set_state(version, VersionState.END)
                self._cond.notify_all()
        log.info("%s version %d reached END", version.model_name, version.version)

    def close(self, timeout_s: float | None = None) -> None:
        """Unloads everything (after in-flight requests drain) and stops retries."""
        self._stopping.set()
        with self._cond:
            self._specs = {}
            self._awaited = set()  # nothing to wait for: held versions unload too
        self.poll()
        for thread in list(self._threads):
            thread.join(timeout_s)
