"""Crash-safe file replacement: a reader sees the old file or the new one, never half.

The recipe: write a temporary file in the same folder, fsync it, rename it over the
target (atomic on POSIX), then fsync the folder so the rename itself survives a power
cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target` atomically.

    The caller writes the temporary file by any means (a library's own writer
    included); on an exception the temporary file is removed and `target` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes) -> None:
    """Replace `target` with `data` atomically and durably."""
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(target, text.encode())
