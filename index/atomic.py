"""Crash-safe file replacement: a reader sees the old file or the new one, never half.

The recipe: write a temporary file in the same folder, fsync it, rename it over the
target (atomic on POSIX), then fsync the folder so the rename itself survives a power
cut.

The files get the mode a plain `open(path, "w")` gives: 0o666 less the process umask
(0644 under the usual umask 022), so that an index or a model can be shared with other
users and read by a container's non-root user. (`tempfile.mkstemp` would make them
owner-only, 0600.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temp_file(target: Path) -> tuple[Path, int]:
    """Create `.{name}.{random}.tmp` beside `target`, empty; return it and its mode.

    Created like `open()` creates a file (requested mode 0o666), so the kernel applies
    the umask (and a default ACL of the folder, if any): the mode read back is the
    normal one for a new file here, learnt without changing the process umask, which
    `os.umask` would do for every thread at once.
    """
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        try:
            return tmp, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    raise FileExistsError(f"no free temporary name beside {target}")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target` atomically.

    The caller writes the temporary file by any means (a library's own writer
    included); on an exception the temporary file is removed and `target` is untouched.
    `target` ends with the normal mode of a new file (0o666 less the umask), also when
    the writer replaced the temporary file with one of another mode.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, mode = _new_temp_file(target)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            if stat.S_IMODE(os.fstat(fh.fileno()).st_mode) != mode:
                os.fchmod(fh.fileno(), mode)
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
