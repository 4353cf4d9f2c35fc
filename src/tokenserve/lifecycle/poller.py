"""Background polling: version directories every --file_system_poll_wait_seconds, the model
config file every --model_config_file_poll_wait_seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.model_config import ModelSpecConfig

log = logging.getLogger("tokenserve.lifecycle")


class Poller:
    """Polls in one daemon thread until `stop()`.

    Args:
        manager: the manager to poll.
        file_system_poll_wait_s: seconds between version scans; 0 scans only at start.
        read_config: returns the current model specs from the config file, or None when
            there is no config file to poll.
        config_poll_wait_s: seconds between config file reads; 0 never rereads.
    """

    def __init__(self, manager: ModelManager, file_system_poll_wait_s: float,
                 read_config: Callable[[], list[ModelSpecConfig]] | None = None,
                 config_poll_wait_s: float = 0.0):
        self._manager = manager
        self._fs_wait = file_system_poll_wait_s
        self._read_config = read_config
        self._config_wait = config_poll_wait_s
        # What the file said when last read: it is reapplied only when its content changes,
        # so a HandleReloadConfigRequest stays in force until the file is edited.
        self._last_file_specs = read_config() if read_config else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifecycle-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        next_fs = time.monotonic() + self._fs_wait
        next_config = time.monotonic() + self._config_wait
        while not self._stop.wait(0.1):
            now = time.monotonic()
            if self._fs_wait > 0 and now >= next_fs:
                next_fs = now + self._fs_wait
                self._guard(self._manager.poll)
            if self._read_config and self._config_wait > 0 and now >= next_config:
                next_config = now + self._config_wait
                self._guard(self._reload_config)

    def _reload_config(self) -> None:
        specs = self._read_config()
        if specs != self._last_file_specs:
            log.info("model config file changed; applying %d models", len(specs))
            self._manager.apply_config(specs, wait=True)
            # Recorded only once applied: a config refused for a passing reason (a label on
            # a version still loading) is tried again at the next poll, not when the file
            # next changes.
            self._last_file_specs = specs

    @staticmethod
    def _guard(step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - a bad config or scan must not stop polling
            log.warning("poll failed: %s", error)
