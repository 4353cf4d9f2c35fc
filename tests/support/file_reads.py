"""Counts the reads of a file by any process (Linux inotify), so a test can wait until a
server has read its config file again rather than sleep for a number of its polls."""

from __future__ import annotations

import ctypes
import os
import struct

IN_CLOSE_NOWRITE = 0x10  # a file opened without writing was closed: one whole read
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class FileReads:
    """`count()`: how many times `path` was opened and closed without writing since this
    object was made. Use as a context manager (it holds an inotify descriptor)."""

    def __init__(self, path):
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(self._fd, os.fsencode(path), IN_CLOSE_NOWRITE) < 0:
            os.close(self._fd)
            raise OSError(ctypes.get_errno(), f"cannot watch {path}")
        self._count = 0

    def count(self) -> int:
        """Reads the pending events. Two reads closer together than this is called may be
        merged into one event by the kernel, so the count is a lower bound."""
        while True:
            try:
                events = os.read(self._fd, 4096)
            except BlockingIOError:
                return self._count
            offset = 0
            while offset < len(events):
                _, mask, _, name_length = _EVENT.unpack_from(events, offset)
                offset += _EVENT.size + name_length
                self._count += bool(mask & IN_CLOSE_NOWRITE)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> "FileReads":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
