"""Reader leases: the committed files that the processes reading an index still use.

A writer commits a generation by replacing manifest.json, then deletes the files no
longer listed. Another process that opened an older generation (a `--read-only`
server, a Ray read replica, a CLI search) still maps those files and opens them again
by path (the scrub, `verify`), so deleting them under it would take its whole index
out of service. As Lucene's deletion policy keeps the commit points readers hold,
every open store takes a lease on the files of the generation it opened::

    INDEX/.readers/<generation>.<pid>.<token>.lease   {"generation": g, "files": [...]}

The lease file is created under a temporary name, locked (an exclusive flock, held
until the lease is released), filled, and only then renamed into place, so a lease a
writer sees is complete and locked. A writer deletes a stale file only when no live
lease names it (`leased_files`); a lease whose lock it can take belongs to a process
that died (the kernel released its flock with it) and is removed, so a crashed
reader never pins files for longer than the next commit.

Holds on a local file system. On shared storage (NFS and most FUSE mounts) flock is
not reliable across machines: there, readers on other machines are not protected
(docs/scale.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

LEASE_DIR = ".readers"
LEASE_SUFFIX = ".lease"
_TEMP_SUFFIX = ".tmp"
_warned: set[Path] = set()  # folders where leases could not be written (logged once)


class Lease:
    """One store's hold on the files of the generation it opened (see the module
    docstring). Released by `release()` or when the process ends."""

    def __init__(self, path: Path, fd: int, generation: int) -> None:
        self.path = path
        self.generation = generation
        self._fd: int | None = fd

    @classmethod
    def take(cls, directory: Path, generation: int, files: Iterable[str]) -> Lease | None:
        """A lease on `files` of `generation`; None when the folder cannot hold one (a
        read-only mount: nothing can delete files there either), logged once."""
        folder = directory / LEASE_DIR
        token = f"{generation}.{os.getpid()}.{secrets.token_hex(6)}"
        temp = folder / f".{token}{_TEMP_SUFFIX}"
        try:
            folder.mkdir(exist_ok=True)
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            if directory not in _warned:
                _warned.add(directory)
                logger.warning(
                    "cannot take a reader lease in %s (%s): a writer may delete the files "
                    "this process reads",
                    folder,
                    exc.strerror or exc,
                )
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else can hold it
            data = json.dumps({"generation": generation, "files": sorted(set(files))})
            os.write(fd, data.encode())
            path = folder / f"{token}{LEASE_SUFFIX}"
            os.rename(temp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        return cls(path, fd, generation)

    def release(self) -> None:
        """Drop the lease: the files are the writer's to delete from its next commit."""
        if self._fd is None:
            return
        # unlinked first: a writer never finds it unlocked while it still exists
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        # a store dropped without close(): its files are no longer read
        self.release()


def leased_files(directory: Path) -> set[str] | None:
    """The files that live leases in `directory` name; removes the leases of processes
    that died. None when a live lease cannot be read: keep every file this time."""
    folder = directory / LEASE_DIR
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return set()
    except OSError:
        return None
    files: set[str] = set()
    for entry in entries:
        if not entry.name.endswith(LEASE_SUFFIX):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY)
        except FileNotFoundError:
            continue  # released meanwhile
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: a live reader
                try:
                    with os.fdopen(os.dup(fd), "rb") as fh:
                        files.update(json.loads(fh.read())["files"])
                except (OSError, ValueError, KeyError, TypeError):
                    return None
            else:  # nobody holds it: its reader died (or released it just now)
                with contextlib.suppress(OSError):
                    entry.unlink()
        finally:
            os.close(fd)
    return files
