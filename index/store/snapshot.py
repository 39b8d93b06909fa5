"""Snapshots of one index directory, as a tar stream, and their restore.

A snapshot holds one committed generation and the journal rows written after it:
exactly the items whose adds and removes were acknowledged when it was taken, as an
`IndexStore.open` of the directory at that moment would see them. It is taken beside
a live writer, as a reader:

1. read manifest.json (its bytes, kept: the snapshot's copy is what was read) and take
   a reader lease (_leases.py) on the files it lists, so that a commit meanwhile does
   not delete them;
2. copy the journal with SQLite's online backup (a consistent copy while rows are
   appended);
3. read the committed generation again: when a commit came in between, the journal
   copy may lack rows that it moved into the new generation and truncated, so the
   snapshot starts over from 1 (at most MAX_ATTEMPTS times).

Sealed files never change once listed, so they are streamed as they are, each
checked against the manifest's checksum as it is read (a damaged file fails the
snapshot instead of being archived). Members, in order: `snapshot.json` (the format,
generation, time and every member's checksum), `manifest.json`, the generation's
files, the model copy, `journal.sqlite` when there is one.

`restore_snapshot` extracts a stream into a new directory: only plain files with
plain names are accepted, each checked against `snapshot.json`, written under a
temporary name beside the target and renamed into place at the end, so a restore
that fails or is killed leaves no half index behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import sqlite3
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..atomic import fsync_dir
from ..json_text import parse_json
from . import manifest as mf
from ._journal import JOURNAL_FILE
from ._leases import Lease
from .errors import StoreError

SNAPSHOT_FILE = "snapshot.json"
SNAPSHOT_FORMAT = 1
MAX_ATTEMPTS = 5
_CHUNK = 1 << 20
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot holds: the generation, its item count, and each member's
    checksum (name -> FileEntry), as `snapshot.json` records them."""

    generation: int
    count: int
    created: str
    files: dict[str, mf.FileEntry]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "generation": self.generation,
            "count": self.count,
            "created": self.created,
            "files": {name: entry.to_json() for name, entry in sorted(self.files.items())},
        }


def write_snapshot(directory: Path, out: IO[bytes]) -> SnapshotInfo:
    """Stream a snapshot of the index in `directory` to `out` (module docstring)."""
    for _ in range(MAX_ATTEMPTS):
        raw = _read_manifest_bytes(directory)
        manifest = mf.parse_manifest(json.loads(raw), directory / mf.MANIFEST)
        files = _generation_files(manifest)
        lease = Lease.take(directory, manifest.generation, files)
        try:
            if mf.committed_generation(directory) != manifest.generation:
                continue  # committed meanwhile: the files may be gone already
            with tempfile.TemporaryDirectory(prefix=".snapshot-", dir=directory) as scratch:
                journal = _copy_journal(directory, Path(scratch))
                if mf.committed_generation(directory) != manifest.generation:
                    continue  # the copy may lack rows that commit took from the journal
                return _write_tar(directory, out, manifest, raw, files, journal)
        finally:
            if lease is not None:
                lease.release()
    raise StoreError(
        f"{directory} committed a new generation during each of {MAX_ATTEMPTS} attempts "
        "to snapshot it; try again when it saves less often"
    )


def _read_manifest_bytes(directory: Path) -> bytes:
    mf.read_manifest_json(directory)  # the clear errors of a missing or broken index
    return (directory / mf.MANIFEST).read_bytes()


def _generation_files(manifest: mf.Manifest) -> dict[str, mf.FileEntry]:
    files = dict(manifest.listed_files())
    model = manifest.model
    if model is not None and model.file and model.checksum is not None:
        files[model.file] = model.checksum
    return files


def _copy_journal(directory: Path, scratch: Path) -> Path | None:
    source = directory / JOURNAL_FILE
    if not source.exists():
        return None
    copy = scratch / JOURNAL_FILE
    reader = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    writer = sqlite3.connect(copy)
    try:
        reader.backup(writer)
    finally:
        writer.close()
        reader.close()
    return copy


def _write_tar(
    directory: Path,
    out: IO[bytes],
    manifest: mf.Manifest,
    raw_manifest: bytes,
    files: dict[str, mf.FileEntry],
    journal: Path | None,
) -> SnapshotInfo:
    members = {
        mf.MANIFEST: mf.FileEntry(hashlib.sha256(raw_manifest).hexdigest(), len(raw_manifest))
    }
    members.update(files)
    if journal is not None:
        members[JOURNAL_FILE] = mf.sha256_file(journal)
    info = SnapshotInfo(manifest.generation, manifest.count, mf.now_iso(), members)
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, SNAPSHOT_FILE, json.dumps(info.to_json(), indent=2).encode())
        _add_bytes(tar, mf.MANIFEST, raw_manifest)
        for name, expected in sorted(files.items()):
            _add_checked(tar, directory / name, name, expected)
        if journal is not None:
            _add_checked(tar, journal, JOURNAL_FILE, members[JOURNAL_FILE])
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    entry = tarfile.TarInfo(name)
    entry.size, entry.mtime, entry.mode = len(data), int(time.time()), 0o644
    tar.addfile(entry, io.BytesIO(data))


class _Hashing(io.RawIOBase):
    """A file read through, its bytes hashed on the way."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.digest, self.size = fh, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.fh.read(len(buffer))
        buffer[: len(data)] = data
        self.digest.update(data)
        self.size += len(data)
        return len(data)


def _add_checked(tar: tarfile.TarFile, path: Path, name: str, expected: mf.FileEntry) -> None:
    with path.open("rb") as fh:
        stat = os.fstat(fh.fileno())
        if stat.st_size != expected.bytes:
            raise StoreError(
                f"{path} is {stat.st_size} bytes, the manifest says {expected.bytes}: "
                "damaged; not snapshotted (run `vitrieval-index verify`)"
            )
        entry = tarfile.TarInfo(name)
        entry.size, entry.mtime, entry.mode = stat.st_size, int(stat.st_mtime), 0o644
        reader = _Hashing(fh)
        tar.addfile(entry, io.BufferedReader(reader, _CHUNK))
    if reader.digest.hexdigest() != expected.sha256:
        raise StoreError(
            f"{path}'s sha256 differs from the manifest's: damaged; not snapshotted "
            "(run `vitrieval-index verify`)"
        )


def restore_snapshot(source: IO[bytes], out: Path) -> SnapshotInfo:
    """Extract a snapshot stream into the new index directory `out` (module docstring)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(
            f"{out} already exists and is not an empty folder: restore makes a new one"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.restore-", dir=out.parent))
    try:
        info = _extract(source, staging)
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()  # the empty folder the caller made, if any
        os.rename(staging, out)
        fsync_dir(out.parent)
        return info
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _extract(source: IO[bytes], staging: Path) -> SnapshotInfo:
    info: SnapshotInfo | None = None
    seen: dict[str, mf.FileEntry] = {}
    try:
        with tarfile.open(fileobj=source, mode="r|") as tar:
            for member in tar:
                if not member.isfile() or not _PLAIN_NAME.fullmatch(member.name):
                    raise StoreError(f"not a vitrieval snapshot: unexpected member {member.name!r}")
                data = tar.extractfile(member)
                assert data is not None  # a regular file
                if info is None:
                    info = _read_info(member.name, data.read())
                    continue
                if member.name not in info.files:
                    raise StoreError(f"not a vitrieval snapshot: {member.name!r} is not listed")
                seen[member.name] = _write_member(data, staging / member.name)
    except (tarfile.TarError, EOFError) as exc:
        raise StoreError(f"not a complete snapshot (a tar stream): {exc}") from None
    if info is None:
        raise StoreError("not a vitrieval snapshot: the stream is empty")
    for name, expected in info.files.items():
        if seen.get(name) != expected:
            what = "missing" if name not in seen else "altered"
            raise StoreError(f"the snapshot is damaged: {name} is {what}")
    for path in staging.iterdir():
        with path.open("rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(staging)
    return info


def read_snapshot_info(source: IO[bytes]) -> SnapshotInfo:
    """What the snapshot stream `source` holds, from its first member (snapshot.json)
    alone: the rest is not read or checked (`restore_snapshot` checks it)."""
    try:
        with tarfile.open(fileobj=source, mode="r|") as tar:
            member = tar.next()
            data = tar.extractfile(member) if member is not None and member.isfile() else None
            if member is None or data is None:
                raise StoreError("not a vitrieval snapshot: the stream is empty")
            return _read_info(member.name, data.read())
    except (tarfile.TarError, EOFError) as exc:
        raise StoreError(f"not a snapshot (a tar stream): {exc}") from None


def _read_info(name: str, data: bytes) -> SnapshotInfo:
    try:
        raw = parse_json(data) if name == SNAPSHOT_FILE else None
        if not isinstance(raw, dict) or raw.get("format") != SNAPSHOT_FORMAT:
            raise ValueError
        files = {
            str(k): mf.FileEntry(str(v["sha256"]), int(v["bytes"])) for k, v in raw["files"].items()
        }
        return SnapshotInfo(int(raw["generation"]), int(raw["count"]), str(raw["created"]), files)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise StoreError(
            f"not a vitrieval snapshot (format {SNAPSHOT_FORMAT}): its first member is not "
            f"a valid {SNAPSHOT_FILE}"
        ) from None


def _write_member(data: IO[bytes], path: Path) -> mf.FileEntry:
    digest, size = hashlib.sha256(), 0
    with path.open("wb") as fh:
        while chunk := data.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            fh.write(chunk)
    return mf.FileEntry(digest.hexdigest(), size)
