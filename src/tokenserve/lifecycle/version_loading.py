"""How one model version comes up and goes down, on the manager's load and unload threads.

Up: the loader builds its servable (a SavedModel Session or a TFLite interpreter), warmup
replays its logged requests, then each registered extension runs (`tokenserve serve`'s
engine). Down: the extensions close, last first, then the servable. The states around these
steps, and the threads, are the manager's (manager.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from tokenserve.lifecycle.model_config import ModelSpecConfig
from tokenserve.lifecycle.version import LoadedVersion

log = logging.getLogger("tokenserve.lifecycle")

Loader = Callable[[ModelSpecConfig, Path], object]
"""(spec, version_dir) -> servable; raises to fail the load."""
Extension = Callable[[LoadedVersion], object]
"""(loaded version) -> object stored in `version.extensions[name]`, or None for nothing."""


class VersionLoading:
    """Brings versions up and tears them down for a ModelManager.

    Args:
        loader: builds a servable from a version directory (see lifecycle.servable_loader).
        warmup: replays warmup records against a loaded version, or None to skip warmup.
        metrics: optional object with `load(model_path, seconds, ok)` and
            `warmup(model_path, seconds)`.
        notify: `(event, version, *args)`, the manager's observer fan-out (`on_load`,
            `on_warmup`).
    """

    def __init__(self, loader: Loader, warmup: Callable[[LoadedVersion], None] | None,
                 metrics, notify: Callable[..., None]):
        self.loader, self.warmup, self.metrics, self.notify = loader, warmup, metrics, notify

    def bring_up(self, version: LoadedVersion, spec: ModelSpecConfig,
                 extensions: list[tuple[str, Extension]]) -> None:
        """Load, warmup, extensions. Observers see one load and one warmup latency per
        version, extensions' own phases included: an extension may report them as
        `startup_seconds = {"load": s, "warmup": s}` (the engine: its weights, its warmup)."""
        begun = started = time.monotonic()
        try:
            version.servable = self.loader(spec, version.path)
        finally:
            load_s = time.monotonic() - started
            if self.metrics:  # the load alone, as TF Serving's load_latency
                self.metrics.load(str(version.path), load_s, version.servable is not None)
            if version.servable is None:
                self.notify("on_load", version, load_s, False)
        phases = {"load": load_s, "warmup": 0.0}
        try:
            if self.warmup is not None:
                started = time.monotonic()
                self.warmup(version)
                phases["warmup"] = time.monotonic() - started
                if self.metrics:
                    self.metrics.warmup(str(version.path), phases["warmup"])
            for name, factory in extensions:
                started = time.monotonic()
                built = factory(version)
                if built is not None:
                    version.extensions[name] = built
                    reported = getattr(built, "startup_seconds", None) or {}
                    for phase in ("load", "warmup"):
                        phases[phase] += reported.get(phase, 0.0)
                    phases[name] = time.monotonic() - started
        finally:
            self.notify("on_load", version, phases["load"], True)
            if self.warmup is not None or phases["warmup"]:
                self.notify("on_warmup", version, phases["warmup"])
        log.info("%s version %d: ready in %.2fs (phases: load %.2fs, warmup %.2fs; %s)",
                 version.model_name, version.version, time.monotonic() - begun,
                 phases["load"], phases["warmup"],
                 ", ".join(f"extension {k} {v:.2f}s" for k, v in phases.items()
                           if k not in ("load", "warmup")) or "no extensions")

    def tear_down(self, version: LoadedVersion) -> None:
        """Closes the version's extensions (last built first) and its servable; never raises."""
        for name, built in reversed(list(version.extensions.items())):
            # close(), or shutdown() for objects that name it so (AsyncEngine).
            close = getattr(built, "close", None) or getattr(built, "shutdown", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - unloading goes on
                    log.exception("closing extension %s of %r failed", name, version)
        version.extensions = {}
        if version.servable is not None:
            try:
                version.servable.close()
            except Exception:  # noqa: BLE001
                log.exception("closing %r failed", version)
        version.servable = None
