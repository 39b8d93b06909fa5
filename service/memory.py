"""Keep the server's memory close to what it uses: large buffers go back to the OS.

glibc's malloc serves a large request (a decoded image, an upload) with mmap and
returns it with munmap, but after the first such free it raises its threshold (up to
32 MiB) and serves later ones of that size from its heaps, which it rarely gives
back. A server that decodes a few large images would then keep their memory for good,
one heap per decoding thread. Setting the threshold explicitly turns that adaptation
off; capping the number of heaps bounds what the threads can strand.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("vitrieval.service")

MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations at least this large are mapped and unmapped on their own."""
MAX_ARENAS = 2
"""malloc heaps shared by all threads (glibc's default is 8 per core)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def return_large_buffers_to_the_os() -> bool:
    """Apply the settings above through glibc's mallopt; False where malloc is not
    glibc's (musl, macOS), which keep no such heaps or cannot be told."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    applied = all(
        mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES),
            (_M_ARENA_MAX, MAX_ARENAS),
        )
    )
    if not applied:
        logger.debug("mallopt refused a setting; memory may be retained after peaks")
    return applied
