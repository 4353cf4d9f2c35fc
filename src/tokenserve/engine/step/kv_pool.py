"""The paged KV pool's variables, whose memory the OS hands out only as blocks are written.

The pool is one [rows, Hkv*Dh] key and one value variable per layer, rows = blocks x
block_size, zero-filled. Filling makes every page resident at load, though sequences take
blocks as they grow and most of a pool sized for long contexts is never written. So once the
variables exist, the whole pages inside each buffer are given back to the OS
(`madvise(MADV_DONTNEED)` on private anonymous memory): they read as zeros, exactly what the
fill wrote, and a page becomes resident again when a step first writes a row into it (a
minor fault). Reads of a page never written map the kernel's shared zero page and cost no
memory; nothing a step computes changes.

Resident memory then grows with the blocks ever written, up to the pool: the block
allocator hands out the most recently freed block first, and prefix caching keeps freed full
blocks' contents for reuse, so a server whose traffic has passed through every block holds
the whole pool. docs/memory.md has the measurements.
"""

from __future__ import annotations

import ctypes
import logging
import re
from pathlib import Path

import tensorflow as tf

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\S+)\s*(.*)$")


def make_kv_pool(num_layers: int, num_rows: int, kv_width: int, dtype: tf.DType,
                 lazy_pages: bool = True) -> list[tuple[tf.Variable, tf.Variable]]:
    """[(key, value)] per layer, each [num_rows, kv_width] of zeros in `dtype`.

    lazy_pages: give the zero pages back to the OS at once (see the module docstring);
        False keeps the whole pool resident from the start.
    """
    released = 0

    def variable(name: str) -> tf.Variable:
        nonlocal released
        made = tf.Variable(tf.zeros([num_rows, kv_width], dtype), trainable=False, name=name)
        if lazy_pages:  # one at a time: the load's peak holds one variable's fill, not all
            released += give_back_zero_pages([made])
        return made

    caches = [tuple(variable(f"{kind}_cache_{i}") for kind in ("key", "value"))
              for i in range(num_layers)]
    if lazy_pages:
        log.info("KV pool: %.1f MiB of zero pages left to the OS until blocks are written",
                 released / 2**20)
    return caches


def give_back_zero_pages(variables: list[tf.Variable]) -> int:
    """Gives back the whole pages of these variables' buffers, which must hold only zeros.

    Only buffers that lie in private anonymous mappings are touched (there a page given back
    reads as zeros again; a private file mapping would read the file's bytes), and only the
    pages wholly inside a buffer. Returns the bytes given back (0 off Linux).
    """
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        anonymous = _private_anonymous_mappings()
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = 4096
    released = 0
    for variable in variables:
        start, num_bytes = _buffer(variable)
        first, end = -(-start // page) * page, (start + num_bytes) // page * page
        inside = any(low <= start and start + num_bytes <= high for low, high in anonymous)
        if end > first and inside and madvise(first, end - first, _MADV_DONTNEED) == 0:
            released += end - first
    return released


def _buffer(variable: tf.Variable) -> tuple[int, int]:
    """(address, bytes) of the variable's own buffer on this CPU.

    The eager value of a resource variable aliases its buffer, and DLPack exports that
    address without a copy; the capsule (a reference to the buffer) is dropped before
    return, so the variable's next sparse access finds its buffer unshared and copies
    nothing.
    """
    capsule = tf.experimental.dlpack.to_dlpack(variable.value())
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    # DLManagedTensor starts with DLTensor, which starts with `void* data`
    address = ctypes.cast(get_pointer(capsule, b"dltensor"), ctypes.POINTER(ctypes.c_void_p))[0]
    del capsule
    return address, variable.shape.num_elements() * variable.dtype.size


def _private_anonymous_mappings() -> list[tuple[int, int]]:
    """[(start, end)] of this process's writable private mappings backed by no file."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        match = _MAPPING.match(line)
        if match is None:
            continue
        start, end, perms, inode, path = match.groups()
        if perms.startswith("rw") and perms[3] == "p" and inode == "0" and (
                not path or path == "[heap]"):
            ranges.append((int(start, 16), int(end, 16)))
    return ranges
