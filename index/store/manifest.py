"""manifest.json: the commit point of an index directory, and the checks made against it.

The manifest names every file of the committed generation with its sha256 and size;
a file is trusted only after it matches both. Writing the manifest (atomically) is
what commits a generation, so anything not named in it is either an older
generation or the debris of an interrupted save, and is never read.

Format 3 lists the sealed segments with their files (each with its columns file,
_columns.py) and tombstones, and the trained quantizer. Format 2 (the same, segments
without columns files) is still read, for read-only use and for `vitrieval-index
upgrade`. Format 1 (one generation: index.<g>.faiss + items.<g>.sqlite) is not parsed
here: reading it is refused with the upgrade command, and only the upgrade
(_upgrade_format1.py) reads it, so that the store never loads that code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..json_text import parse_json
from .errors import ScrubStopped, StoreError, WriterLockTimeout

# the entries a manifest holds, defined apart (manifest_entries.py), named here as ever
from .manifest_entries import FORMAT_VERSION as FORMAT_VERSION
from .manifest_entries import METRIC as METRIC
from .manifest_entries import CalibrationEntry as CalibrationEntry
from .manifest_entries import CalibrationLevel as CalibrationLevel
from .manifest_entries import DbaEntry as DbaEntry
from .manifest_entries import FileEntry as FileEntry
from .manifest_entries import Manifest as Manifest
from .manifest_entries import ModelEntry as ModelEntry
from .manifest_entries import NamedFile as NamedFile
from .manifest_entries import SegmentEntry as SegmentEntry
from .manifest_entries import TombstoneEntry as TombstoneEntry
from .manifest_entries import TuningEntry as TuningEntry

logger = logging.getLogger(__name__)

SEGMENT_DBA_FORMAT_VERSION = 3
"""DBA vectors inside segments (seg.<n>.dba.*): read without them, not written."""
COLUMNLESS_FORMAT_VERSION = 2
"""Segments without columns files: read (their field index answers), not written."""
UPGRADE_ONLY_FORMAT_VERSION = 1
"""Format 1: opened by `vitrieval-index upgrade` alone (_upgrade_format1.py)."""
MANIFEST = "manifest.json"
MODEL_COPY_FILE = "model.onnx"
UPLOADS_DIR = "uploads"
"""INDEX/uploads: the images a server keeps for the items added through its API."""
LOCK_FILE = ".lock"
WRITER_LOCK_WAIT_S = 5.0
"""The longest a save or a merge waits for DIR/.lock before giving up (it is retried
later): short enough that a server's shutdown stays within its grace period."""
_LOCK_POLL_S = 0.05
_CHUNK = 1 << 20

# What a save writes before its commit, but `model.onnx` (the name a user's own model
# may have): what an interrupted first save can leave in a folder with no manifest.
_SAVE_FILE = re.compile(
    r"model\.\d+\.onnx|quantizer\.\d+\.faiss"
    r"|seg\.\d+\.(faiss|items\.sqlite|vectors\.npy|columns|del\.\d+\.npy|dba\.faiss|dba\.npy)"
    r"|dba\.\d+\.(ids\.)?npy"
)
# Every name the store ever writes; only these are checked, read or cleaned up, so
# anything else a user keeps in the folder is left alone. index.<g>.faiss and
# items.<g>.sqlite are format 1's: the first save after its upgrade removes them.
_STORE_FILE = re.compile(
    r"(index\.\d+\.faiss|items\.\d+\.sqlite|model\.onnx|" + _SAVE_FILE.pattern + ")"
)
_TEMP_FILE = re.compile(r"\.(manifest\.json|" + _STORE_FILE.pattern + r")\..+\.tmp")


def segment_index_file(number: int) -> str:
    return f"seg.{number}.faiss"


def segment_items_file(number: int) -> str:
    return f"seg.{number}.items.sqlite"


def segment_vectors_file(number: int) -> str:
    return f"seg.{number}.vectors.npy"


def segment_columns_file(number: int) -> str:
    """Segment `number`'s columns of its indexed paths (_columns.py; format 3)."""
    return f"seg.{number}.columns"


def dba_ids_file(generation: int) -> str:
    """The derived DBA index of `generation`: sorted int64 ids (_dba.py)."""
    return f"dba.{generation}.ids.npy"


def dba_vectors_file(generation: int) -> str:
    """The derived DBA index of `generation`: float32 (n, dim) DBA vectors."""
    return f"dba.{generation}.npy"


def tombstone_file(number: int, generation: int) -> str:
    return f"seg.{number}.del.{generation}.npy"


def quantizer_file(generation: int) -> str:
    return f"quantizer.{generation}.faiss"


def model_file(generation: int) -> str:
    """Name for a model copy that must not overwrite a committed model.onnx (see save)."""
    return f"model.{generation}.onnx"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def sha256_file(path: Path, bytes_per_s: float | None = None, stop: Any = None) -> FileEntry:
    """Checksum a file by streaming it (model files can be hundreds of MB), at most
    `bytes_per_s` when given; `stop` (an Event) set meanwhile raises ScrubStopped."""
    digest = hashlib.sha256()
    size = 0
    started = time.monotonic()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if stop is not None and stop.is_set():
                raise ScrubStopped(str(path))
            if bytes_per_s:
                ahead = size / bytes_per_s - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
    return FileEntry(digest.hexdigest(), size)


def require_field(
    data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: Path
) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise StoreError(f"{where} is invalid: field {key!r} is missing or malformed")
    return value


def parse_file_entry(raw: Any, name: str, where: Path) -> FileEntry:
    if not (
        isinstance(raw, dict)
        and isinstance(raw.get("sha256"), str)
        and isinstance(raw.get("bytes"), int)
    ):
        raise StoreError(f"{where} is invalid: no checksum for {name}")
    return FileEntry(raw["sha256"], raw["bytes"])


def parse_model_entry(raw: Any, where: Path) -> ModelEntry | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise StoreError(f"{where} is invalid: field 'model' is malformed")
    name = raw.get("file")
    if name is None:
        return ModelEntry(fingerprint=raw.get("fingerprint"))
    if not (isinstance(name, str) and _STORE_FILE.fullmatch(name) and name.endswith(".onnx")):
        raise StoreError(f"{where} is invalid: unexpected model file name {name!r}")
    return ModelEntry(raw.get("fingerprint"), name, parse_file_entry(raw, name, where))


def _parse_named(raw: Any, where: Path, pattern: re.Pattern[str]) -> NamedFile:
    if not isinstance(raw, dict) or not isinstance(raw.get("file"), str):
        raise StoreError(f"{where} is invalid: a file entry without a name")
    name = raw["file"]
    if not pattern.fullmatch(name):
        raise StoreError(f"{where} is invalid: unexpected file name {name!r}")
    return NamedFile(name, parse_file_entry(raw, name, where))


_SEGMENT_FILE = re.compile(
    r"seg\.\d+\.(faiss|items\.sqlite|vectors\.npy|columns|dba\.faiss|dba\.npy)"
)
_SEGMENT_DBA_FILE = re.compile(r"seg\.\d+\.dba\.(faiss|npy)")
_TOMBSTONE_FILE = re.compile(r"seg\.\d+\.del\.\d+\.npy")
_QUANTIZER_FILE = re.compile(r"quantizer\.\d+\.faiss")
_DBA_FILE = re.compile(r"dba\.\d+\.(ids\.)?npy")


def _parse_segment(raw: Any, where: Path, version: int) -> SegmentEntry:
    if not isinstance(raw, dict):
        raise StoreError(f"{where} is invalid: a segment entry is not an object")
    number = require_field(raw, "number", int, where)
    files = {}
    for name, entry in require_field(raw, "files", dict, where).items():
        if not (_SEGMENT_FILE.fullmatch(name) and name.startswith(f"seg.{number}.")):
            raise StoreError(f"{where} is invalid: unexpected segment file name {name!r}")
        if _SEGMENT_DBA_FILE.fullmatch(name):
            if version > SEGMENT_DBA_FORMAT_VERSION:
                raise StoreError(f"{where} is invalid: unexpected segment file name {name!r}")
            # format 3's DBA vectors inside a segment: never read now (_dba.py keeps
            # a derived index instead), so left out of the entry; the first commit
            # after the upgrade removes the files
            continue
        files[name] = parse_file_entry(entry, name, where)
    required = [segment_index_file(number), segment_items_file(number)]
    if version > COLUMNLESS_FORMAT_VERSION:
        required.append(segment_columns_file(number))
    for name in required:
        if name not in files:
            raise StoreError(f"{where} is invalid: segment {number} does not list {name}")
    tombstones = None
    if raw.get("tombstones") is not None:
        named = _parse_named(raw["tombstones"], where, _TOMBSTONE_FILE)
        count = raw["tombstones"].get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise StoreError(f"{where} is invalid: segment {number}'s tombstone count")
        tombstones = TombstoneEntry(named.name, named.checksum, count)
    in_order = raw.get("rows_in_id_order", False)
    if not isinstance(in_order, bool):
        raise StoreError(f"{where} is invalid: segment {number}'s rows_in_id_order")
    rows = require_field(raw, "rows", int, where)
    return SegmentEntry(number, rows, files, tombstones, rows_in_id_order=in_order)


def parse_manifest(data: Any, where: Path) -> Manifest:
    """Validate the JSON of a manifest; StoreError names the first problem found."""
    if not isinstance(data, dict):
        raise StoreError(f"{where} is invalid: not a JSON object")
    version = require_field(data, "format_version", int, where)
    if version > FORMAT_VERSION:
        raise StoreError(
            f"{where} has format_version {version}, newer than this vitrieval reads "
            f"({FORMAT_VERSION}); upgrade vitrieval"
        )
    if data.get("metric") != METRIC:
        raise StoreError(f"{where} has metric {data.get('metric')!r}; only {METRIC!r} is known")
    generation = require_field(data, "generation", int, where)
    common = {
        "generation": generation,
        "dim": require_field(data, "dim", int, where),
        "factory": require_field(data, "factory", str, where),
        "count": require_field(data, "count", int, where),
        "model": parse_model_entry(data.get("model"), where),
        "created": str(data.get("created", "")),
        "updated": str(data.get("updated", "")),
    }
    if version == UPGRADE_ONLY_FORMAT_VERSION:
        raise StoreError(upgrade_only_message(where.parent, version))
    raw_segments = data.get("segments")
    if not isinstance(raw_segments, list):
        raise StoreError(f"{where} is invalid: field 'segments' is missing or malformed")
    quantizer = data.get("quantizer")
    params = data.get("search_params") or {}
    if not isinstance(params, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in params.values()
    ):
        raise StoreError(f"{where} is invalid: field 'search_params' is malformed")
    filter_fields = data.get("filter_fields")
    if filter_fields is not None and (
        not isinstance(filter_fields, list) or not all(isinstance(p, str) for p in filter_fields)
    ):
        raise StoreError(f"{where} is invalid: field 'filter_fields' is malformed")
    dba = data.get("dba")
    if dba is not None and not (
        isinstance(dba, dict)
        and isinstance(dba.get("neighbours"), int)
        and isinstance(dba.get("alpha"), int | float)
    ):
        raise StoreError(f"{where} is invalid: field 'dba' is malformed")
    dba_index = None
    if dba is not None and "vectors" in dba:
        dba_index = DbaEntry(
            int(dba["neighbours"]),
            float(dba["alpha"]),
            require_field(dba, "generation", int, where),
            require_field(dba, "count", int, where),
            _parse_named(dba.get("ids"), where, _DBA_FILE),
            _parse_named(dba.get("vectors"), where, _DBA_FILE),
        )
    records = {}  # what `tune` and `calibrate` measured: absent in older manifests
    for name, entry in (("tuning", TuningEntry), ("calibration", CalibrationEntry)):
        raw = data.get(name)
        records[name] = None if raw is None else entry.from_json(raw)
        if raw is not None and records[name] is None:
            raise StoreError(f"{where} is invalid: field {name!r} is malformed")
    return Manifest(
        **common,
        **records,
        format_version=version,
        dba=None if dba is None else (int(dba["neighbours"]), float(dba["alpha"])),
        dba_index=dba_index,
        filter_fields=None if filter_fields is None else tuple(filter_fields),
        segments=tuple(_parse_segment(raw, where, version) for raw in raw_segments),
        quantizer=None if quantizer is None else _parse_named(quantizer, where, _QUANTIZER_FILE),
        next_id=require_field(data, "next_id", int, where),
        search_params={str(k): int(v) for k, v in params.items()},
        journal=_parse_journal(data.get("journal"), where),
    )


def _parse_journal(raw: Any, where: Path) -> tuple[int, int] | None:
    if raw is None:
        return None
    if not (
        isinstance(raw, dict)
        and all(
            isinstance(raw.get(k), int) and not isinstance(raw[k], bool) for k in ("id", "upto")
        )
    ):
        raise StoreError(f"{where} is invalid: field 'journal' is malformed")
    return raw["id"], raw["upto"]


def older_format_message(directory: Path, version: int) -> str:
    """Why an index of format 2 (segments without columns files) is not written: what
    a save, a merge and a journalling open say."""
    return (
        f"{directory} is an index of format {version}, which this vitrieval reads but "
        f"does not write: convert it with `vitrieval-index upgrade {directory}`"
    )


def upgrade_only_message(directory: Path, version: int) -> str:
    """Why an index of format 1 does not open: only the upgrade reads it."""
    return (
        f"{directory} is an index of format {version}, which this vitrieval does not "
        f"open: convert it with `vitrieval-index upgrade {directory}`"
    )


def read_manifest_json(directory: Path) -> Any:
    """DIR/manifest.json as JSON, unvalidated; a missing or unreadable one is a
    StoreError."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise StoreError(f"no index at {directory}: the folder does not exist")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise StoreError(f"no index at {directory}: {MANIFEST} not found") from None
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = parse_json(text)
    except ValueError:
        raise StoreError(f"{path} is not valid JSON (damaged or not an index manifest)") from None
    return data


def read_manifest(directory: Path) -> Manifest:
    """Load and validate DIR/manifest.json; a missing or unreadable one, or one of
    format 1, is a StoreError."""
    return parse_manifest(read_manifest_json(directory), directory / MANIFEST)


def stored_format_version(directory: Path) -> int | None:
    """The format_version DIR/manifest.json states (None: none readable); the upgrade
    picks its converter by it, before anything is parsed."""
    return _stated_integer(directory, "format_version")


def committed_generation(directory: Path) -> int | None:
    """The generation on disk now, or None when there is no readable manifest.

    Lenient on purpose: used only to detect another writer, never to load.
    """
    # read, not parsed: a format-1 manifest the upgrade replaces counts as well
    return _stated_integer(directory, "generation")


def _stated_integer(directory: Path, name: str) -> int | None:
    """The integer field `name` of DIR/manifest.json as written, unparsed (None when
    the file is unreadable or the field is not an integer)."""
    try:
        data = read_manifest_json(directory)
    except StoreError:
        return None
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Commit `manifest` (atomic replace + fsync): from here on this generation is the index."""
    atomic_write_text(directory / MANIFEST, json.dumps(manifest.to_json(), indent=2) + "\n")


def _check_size_and_sum(path: Path, expected: FileEntry, actual: FileEntry) -> None:
    if actual.bytes != expected.bytes:
        raise StoreError(
            f"checksum mismatch in {path}: {actual.bytes} bytes, the manifest says "
            f"{expected.bytes} (truncated or altered); refusing to load it"
        )
    if actual.sha256 != expected.sha256:
        raise StoreError(
            f"checksum mismatch in {path}: its sha256 differs from the manifest's "
            "(the file was altered or damaged); refusing to load it"
        )


def read_verified(directory: Path, name: str, expected: FileEntry) -> bytes:
    """The bytes of DIR/name, only if they match the manifest's size and sha256.

    The caller deserialises exactly these bytes, so nothing can change the file
    between the check and the use.
    """
    path = directory / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{path} is missing; the index is incomplete") from None
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from None
    _check_size_and_sum(path, expected, FileEntry(hashlib.sha256(data).hexdigest(), len(data)))
    return data


def verify_file(
    directory: Path,
    name: str,
    expected: FileEntry,
    bytes_per_s: float | None = None,
    stop: Any = None,
) -> Path:
    """Check DIR/name against the manifest by streaming it (for files not loaded here);
    `bytes_per_s` paces the reading (a background scrub must not starve searches)."""
    path = directory / name
    try:
        actual = sha256_file(path, bytes_per_s, stop)
    except FileNotFoundError:
        raise StoreError(f"{path} is missing; the index is incomplete") from None
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from None
    _check_size_and_sum(path, expected, actual)
    return path


def is_save_debris(name: str) -> bool:
    """Whether `name` is a file a save writes before its commit (the model copy
    `model.onnx` aside) or the temporary file of any store write."""
    return bool(_SAVE_FILE.fullmatch(name) or _TEMP_FILE.fullmatch(name))


def remove_stale(directory: Path, keep: set[str]) -> list[str]:
    """Delete store files not in `keep` (older generations, interrupted saves' temp files).

    Runs after a commit; a failure here only leaves debris for the next save, so it is
    logged, not raised.
    """
    removed = []
    for entry in directory.iterdir():
        name = entry.name
        if name in keep or not (_STORE_FILE.fullmatch(name) or _TEMP_FILE.fullmatch(name)):
            continue
        try:
            entry.unlink()
            removed.append(name)
        except OSError as exc:
            logger.warning("could not remove stale index file %s: %s", entry, exc)
    return removed


@contextlib.contextmanager
def writer_lock(directory: Path, wait_s: float = WRITER_LOCK_WAIT_S) -> Iterator[None]:
    """Hold an exclusive advisory lock on DIR/.lock for one save or merge.

    Two processes saving into one folder would otherwise race on the generation
    number; the kernel drops the lock if the holder dies, so a crash never leaves
    the folder locked. The wait is bounded (`wait_s`): a lock another process keeps
    is a `WriterLockTimeout`, so a checkpoint retries later instead of hanging, and
    a shutdown is never held up by it.
    """
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise WriterLockTimeout(
                        f"{directory / LOCK_FILE} is held by another process (a save or "
                        f"merge running elsewhere?); gave up after {wait_s:g} s"
                    ) from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)
