"""The embeddings folder: a catalogue's embeddings as Parquet files, apart from any index.

`vitrieval-index embed` writes one; `vitrieval-index build --embeddings` reads one. So
does any other engine (Ray Data, Spark) that writes the same contract::

    EMB/
      embeddings.json     {"dim": D, "model_fingerprint": "<sha256>", ...}
      *.parquet           the rows, read in sorted order of file name

Every `*.parquet` file (names starting with "." or "_", such as Spark's `_SUCCESS`,
are skipped) holds rows with the columns

- `key` (string, required, non-empty, unique across all files),
- `embedding` (list of float32 of length D, required; a list of float16 or float64 is
  read as float32),
- `label`, `path` (string, optional, may be null),
- `metadata` (optional: JSON text of an object, or null).

Other columns are ignored. `embeddings.json` needs at least `dim` and
`model_fingerprint` (the `vitrieval.fingerprint` of the model that made the vectors);
`embed` also records `model` (the model file's path), the counts, and each part's
input range and checksum (what lets it resume, see `vitrieval.index.pipeline.embed_folder`). A
folder whose
`complete` is false is an embed still running or interrupted, and is refused.

Vectors: as they are read, finite non-zero vectors are scaled to unit L2 norm (the
store takes unit vectors only, and the scores are cosines); a vector that is all
zeros or holds NaN or an infinity is refused, with its key and file. The model's own
vectors are already unit, so they pass through unchanged to float32 rounding.

Every problem is a `EmbeddingsError` (a ValueError) with one line naming the file,
and the row or key where there is one. Reading is streamed: `iter_batches` holds one
Parquet batch (at most `batch_size` rows) at a time, and `check_unique_keys` 8 bytes
per row (a hash of each key).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import atomic_path, atomic_write_text
from ..json_text import parse_json
from ..store.filters import find_outside_int64, int64_message
from ..unit_vectors import unit_rows

META_FILE = "embeddings.json"
ERRORS_FILE = "errors.csv"
FORMAT = "vitrieval-embeddings"
VERSION = 1
BATCH_ROWS = 8192
"""Rows per Parquet row group written, and per batch read by default."""

REQUIRED = ("key", "embedding")
OPTIONAL = ("label", "path", "metadata")


class EmbeddingsError(ValueError):
    """An embeddings folder that cannot be read or used; the message says where and why."""


def part_name(number: int) -> str:
    """`part-00000.parquet`, the name of `embed`'s part `number`."""
    return f"part-{number:05d}.parquet"


def schema() -> pa.Schema:
    """The schema `write_part` writes."""
    return pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("embedding", pa.list_(pa.float32()), nullable=False),
            pa.field("label", pa.string()),
            pa.field("path", pa.string()),
            pa.field("metadata", pa.string()),
        ]
    )


def write_part(
    target: Path,
    keys: Sequence[str],
    embeddings: np.ndarray,
    *,
    labels: Sequence[str | None] | None = None,
    paths: Sequence[str | None] | None = None,
    metadata: Sequence[dict | None] | None = None,
    row_group_size: int = BATCH_ROWS,
) -> None:
    """Write one Parquet part atomically (a reader sees the whole file or none)."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    n = len(keys)
    if x.ndim != 2 or len(x) != n:
        raise EmbeddingsError(f"{n} keys but embeddings of shape {x.shape}")
    offsets = pa.array(np.arange(0, (n + 1) * x.shape[1], x.shape[1], dtype=np.int32))
    columns = {
        "key": pa.array(list(keys), pa.string()),
        "embedding": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1), pa.float32())),
        "label": pa.array(_column(labels, n), pa.string()),
        "path": pa.array(_column(paths, n), pa.string()),
        "metadata": pa.array(
            [None if m is None else json.dumps(m, sort_keys=True) for m in _column(metadata, n)],
            pa.string(),
        ),
    }
    table = pa.Table.from_arrays(list(columns.values()), schema=schema())
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp, row_group_size=max(1, row_group_size))


def _column(values: Sequence[Any] | None, n: int) -> list[Any]:
    if values is None:
        return [None] * n
    if len(values) != n:
        raise EmbeddingsError(f"a column has {len(values)} values for {n} keys")
    return list(values)


def read_meta(folder: Path) -> dict[str, Any]:
    """embeddings.json, checked for `dim` and `model_fingerprint`."""
    path = folder / META_FILE
    if not folder.is_dir():
        raise EmbeddingsError(f"embeddings folder not found: {folder}")
    if not path.is_file():
        raise EmbeddingsError(
            f"{folder} has no {META_FILE}; an embeddings folder needs one with "
            '{"dim": D, "model_fingerprint": "<sha256>"} (`vitrieval-index embed` writes it)'
        )
    try:
        meta = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EmbeddingsError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise EmbeddingsError(f"{path}: expected a JSON object")
    dim = meta.get("dim")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise EmbeddingsError(f"{path}: 'dim' must be a positive integer, got {dim!r}")
    fingerprint = meta.get("model_fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise EmbeddingsError(
            f"{path}: 'model_fingerprint' must be the model's fingerprint (a sha256 text), "
            f"got {fingerprint!r}"
        )
    model = meta.get("model")
    if model is not None and not isinstance(model, str):
        raise EmbeddingsError(f"{path}: 'model' must be a file path, got {model!r}")
    return meta


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    atomic_write_text(folder / META_FILE, json.dumps(meta, indent=2) + "\n")


def list_parts(folder: Path) -> list[Path]:
    """Every `*.parquet` file in `folder`, sorted by name; hidden ones (".", "_") skipped."""
    return sorted(
        p for p in folder.glob("*.parquet") if p.is_file() and not p.name.startswith((".", "_"))
    )


@dataclass
class EmbeddingBatch:
    """Up to `batch_size` rows of one part: unit float32 vectors (n, D) and their columns."""

    part: Path
    keys: list[str]
    embeddings: np.ndarray
    labels: list[str | None]
    paths: list[str | None]
    metadata: list[dict | None]


class EmbeddingsFolder:
    """An embeddings folder, opened: its metadata checked, and every part's schema (read
    from the Parquet footers only; rows are checked as they are read)."""

    def __init__(self, folder: Path, meta: dict[str, Any], parts: list[Path], rows: list[int]):
        self.folder = folder
        self.meta = meta
        self.dim: int = meta["dim"]
        self.fingerprint: str = meta["model_fingerprint"]
        self.model: Path | None = Path(meta["model"]) if meta.get("model") else None
        self.parts = parts
        self.rows = rows
        self.count = sum(rows)

    @classmethod
    def open(cls, folder: str | Path) -> EmbeddingsFolder:
        folder = Path(folder)
        meta = read_meta(folder)
        if meta.get("complete") is False:
            done = len(meta.get("parts") or [])
            raise EmbeddingsError(
                f"{folder} is incomplete (its embed stopped after {done} part(s)): run the "
                "same `vitrieval-index embed` again to finish it"
            )
        parts = list_parts(folder)
        if not parts:
            raise EmbeddingsError(f"{folder} holds no *.parquet files")
        rows = [_check_schema(part) for part in parts]
        return cls(folder, meta, parts, rows)

    def iter_batches(self, batch_size: int = BATCH_ROWS) -> Iterator[EmbeddingBatch]:
        """Every row, part by part, in batches of at most `batch_size` rows, validated and
        with unit vectors."""
        for part in self.parts:
            reader = pq.ParquetFile(part)
            present = [c for c in (*REQUIRED, *OPTIONAL) if c in reader.schema_arrow.names]
            start = 0
            for batch in reader.iter_batches(batch_size=batch_size, columns=present):
                yield self._convert(part, batch, start)
                start += batch.num_rows

    def iter_keys(self, batch_size: int = BATCH_ROWS) -> Iterator[tuple[Path, list[str]]]:
        """(part, keys) in batches, reading the key column only."""
        for part in self.parts:
            reader = pq.ParquetFile(part)
            start = 0
            for batch in reader.iter_batches(batch_size=batch_size, columns=["key"]):
                yield part, _keys(part, batch.column(0), start)
                start += batch.num_rows

    def check_unique_keys(self, batch_size: int = BATCH_ROWS) -> None:
        """Refuse a key that appears twice, in one part or across parts.

        A first pass keeps a 64-bit hash per row (8 bytes each); only when two hashes
        agree does a second pass look at the keys behind them."""
        hashes = np.empty(self.count, dtype=np.int64)
        at = 0
        for _, keys in self.iter_keys(batch_size):
            hashes[at : at + len(keys)] = np.fromiter(map(hash, keys), np.int64, len(keys))
            at += len(keys)
        hashes.sort()
        twice = hashes[1:][hashes[1:] == hashes[:-1]]
        if twice.size == 0:
            return
        suspects = set(twice.tolist())
        seen: dict[str, Path] = {}
        for part, keys in self.iter_keys(batch_size):
            for key in keys:
                if hash(key) in suspects:
                    if key in seen:
                        where = "" if seen[key] == part else f" and {seen[key].name}"
                        raise EmbeddingsError(
                            f"{self.folder}: key {key!r} appears more than once (in "
                            f"{part.name}{where}); keys must be unique across all parts"
                        )
                    seen[key] = part

    def sample(self, size: int, batch_size: int = BATCH_ROWS, seed: int = 0) -> np.ndarray:
        """A uniform random sample of at most `size` vectors, in one streaming pass
        (reservoir sampling): what an IVF or PQ index is trained on."""
        reservoir = Reservoir(min(size, self.count), self.dim, seed)
        for batch in self.iter_batches(batch_size):
            reservoir.add(batch.embeddings)
        return reservoir.sample

    def _convert(self, part: Path, batch: pa.RecordBatch, start: int) -> EmbeddingBatch:
        names = batch.schema.names
        keys = _keys(part, batch.column(names.index("key")), start)
        vectors = _vectors(part, batch.column(names.index("embedding")), self.dim, keys, start)

        def text(name: str) -> list[str | None]:
            if name not in names:
                return [None] * len(keys)
            return batch.column(names.index(name)).to_pylist()

        metadata = [
            _metadata(part, value, key) for value, key in zip(text("metadata"), keys, strict=True)
        ]
        return EmbeddingBatch(part, keys, vectors, text("label"), text("path"), metadata)


class Reservoir:
    """Algorithm R over batches: after any number of rows, `sample` is a uniform random
    subset of at most `size` of them (a row's slot is drawn as if rows came one by one)."""

    def __init__(self, size: int, dim: int, seed: int = 0) -> None:
        self.size = size
        self._rows = np.empty((size, dim), np.float32)
        self._filled = 0
        self.seen = 0
        self._rng = np.random.default_rng(seed)

    @property
    def sample(self) -> np.ndarray:
        return self._rows[: self._filled]

    def add(self, x: np.ndarray) -> None:
        take = min(len(x), self.size - self._filled)
        self._rows[self._filled : self._filled + take] = x[:take]
        self._filled += take
        rest = x[take:]
        if len(rest):
            # row number t (0-based, over all rows) replaces slot j ~ U{0..t} when j < size
            t = self.seen + take + np.arange(len(rest))
            slots = self._rng.integers(0, t + 1)
            chosen = np.flatnonzero(slots < self.size)
            # several rows may draw one slot: the last of them wins, as one by one
            _, last = np.unique(slots[chosen][::-1], return_index=True)
            chosen = chosen[len(chosen) - 1 - last]
            self._rows[slots[chosen]] = rest[chosen]
        self.seen += len(x)


def _check_schema(part: Path) -> int:
    """The part's row count, once its columns are the contract's; from the footer only."""
    try:
        metadata = pq.read_metadata(part)
        arrow = metadata.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as exc:
        raise EmbeddingsError(f"{part}: not a readable Parquet file ({exc})") from None
    missing = [c for c in REQUIRED if c not in arrow.names]
    if missing:
        raise EmbeddingsError(
            f"{part}: missing column(s) {', '.join(missing)} (found {', '.join(arrow.names)}); "
            "an embeddings part needs key and embedding"
        )
    for name in arrow.names:
        if arrow.names.count(name) > 1 and name in (*REQUIRED, *OPTIONAL):
            raise EmbeddingsError(f"{part}: column {name} appears twice")
    kind = arrow.field("key").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise EmbeddingsError(f"{part}: column key must be string, got {kind}")
    kind = arrow.field("embedding").type
    listed = (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )
    if not listed or not pa.types.is_floating(kind.value_type):
        raise EmbeddingsError(f"{part}: column embedding must be a list of float32, got {kind}")
    for name in OPTIONAL:
        if name in arrow.names:
            kind = arrow.field(name).type
            if not (
                pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            ):
                raise EmbeddingsError(f"{part}: column {name} must be string, got {kind}")
    return metadata.num_rows


def _keys(part: Path, column: pa.Array, start: int) -> list[str]:
    keys = column.to_pylist()
    if column.null_count or not all(keys):
        row = next(i for i, key in enumerate(keys) if not key)
        raise EmbeddingsError(f"{part}: row {start + row} has an empty or null key")
    return keys


def _vectors(part: Path, column: pa.Array, dim: int, keys: list[str], start: int) -> np.ndarray:
    """A list column -> float32 (n, dim), unit rows; refuses nulls, other lengths,
    non-finite and zero vectors."""
    n = len(column)

    def where(row: int) -> str:
        return f"{part}: row {start + row} (key {keys[row]!r})"

    if column.null_count:
        row = next(i for i, valid in enumerate(column.is_valid().to_pylist()) if not valid)
        raise EmbeddingsError(f"{where(row)} has no embedding (null)")
    if pa.types.is_fixed_size_list(column.type):
        lengths = np.full(n, column.type.list_size)
    else:
        lengths = np.diff(column.offsets.to_numpy())
    wrong = np.flatnonzero(lengths != dim)
    if wrong.size:
        row = int(wrong[0])
        raise EmbeddingsError(
            f"{where(row)} has an embedding of length {lengths[row]}, not {dim} "
            f"(the dim in {META_FILE})"
        )
    values = column.flatten()
    if values.null_count:
        row = int(np.flatnonzero(~values.is_valid().to_numpy(zero_copy_only=False))[0]) // dim
        raise EmbeddingsError(f"{where(row)} has a null inside its embedding")
    # float64: a float64 column's large values stay finite until normalised
    x = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False).reshape(n, dim)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        raise EmbeddingsError(f"{where(row)} has a NaN or infinite value in its embedding")
    unit, ok = unit_rows(x)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        raise EmbeddingsError(f"{where(row)} has an all-zero embedding (it has no direction)")
    return np.ascontiguousarray(unit)


def _metadata(part: Path, value: str | None, key: str) -> dict | None:
    if value is None:
        return None
    try:
        parsed = parse_json(value)
    except ValueError as exc:
        raise EmbeddingsError(f"{part}: key {key!r}: metadata is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise EmbeddingsError(f"{part}: key {key!r}: metadata must be a JSON object")
    place = find_outside_int64(parsed, "metadata")
    if place is not None:
        raise EmbeddingsError(f"{part}: key {key!r}: {int64_message(place)}")
    return parsed
