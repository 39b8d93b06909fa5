"""Validation of what callers pass to the store: vectors, keys and per-item columns.

Everything here raises StoreError with one sentence saying what was wrong, before the
store changes anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .errors import StoreError
from .filters import find_outside_int64, int64_message

UNIT_NORM_TOLERANCE = 1e-3  # |norm - 1| allowed for added vectors (float32 rounding is ~1e-7)


def as_matrix(vectors: Any, dim: int, what: str) -> np.ndarray:
    """Validate `vectors` as a finite (n, dim) array; returns C-contiguous float32."""
    try:
        x = np.ascontiguousarray(vectors, dtype=np.float32)
    except (TypeError, ValueError):
        raise StoreError(f"{what} must be a numeric (n, {dim}) array") from None
    if x.ndim != 2 or x.shape[1] != dim:
        raise StoreError(f"{what} must have shape (n, {dim}), got {x.shape}")
    # the ufunc's own reduction: ndarray.all goes through a Python wrapper, which every
    # search would pay for
    if not np.logical_and.reduce(np.isfinite(x), axis=None):
        raise StoreError(f"{what} contain NaN or infinite values")
    return x


def check_unit(x: np.ndarray) -> None:
    """Scores are cosines only for unit vectors; refuse others rather than rank wrongly."""
    if len(x) == 0:
        return
    norms = np.linalg.norm(x, axis=1)
    worst = float(np.abs(norms - 1.0).max())
    if worst > UNIT_NORM_TOLERANCE:
        raise StoreError(
            f"vectors must be L2-normalised; norms range from {norms.min():.4g} to "
            f"{norms.max():.4g}"
        )


def text_column(values: Sequence[Any] | None, n: int, name: str) -> list[str | None]:
    """An optional per-item text column (labels, paths): None, or n values (str() each)."""
    if values is None:
        return [None] * n
    if isinstance(values, str) or len(values) != n:
        raise StoreError(f"{name} must be a sequence with one entry per key ({n})")
    return [None if v is None else str(v) for v in values]


def metadata_column(values: Sequence[Any] | None, n: int) -> list[str]:
    """Per-item metadata as JSON text ("{}" for none); each a dict of JSON values whose
    integers fit int64 (SQLite's integers: a larger one could be journalled, then
    never applied)."""
    if values is None:
        return ["{}"] * n
    if len(values) != n:
        raise StoreError(f"metadata must be a sequence with one dict per key ({n})")
    encoded = []
    for value in values:
        if value is not None and not isinstance(value, dict):
            raise StoreError(f"metadata entries must be dicts, got {type(value).__name__}")
        place = find_outside_int64(value, "metadata")
        if place is not None:
            raise StoreError(int64_message(place))
        try:
            encoded.append(json.dumps(value or {}, sort_keys=True, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise StoreError(f"metadata must be JSON-serialisable: {exc}") from None
    return encoded


def check_keys(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        raise StoreError("keys must be a sequence of strings, not one string")
    keys = list(keys)
    if not all(isinstance(key, str) and key for key in keys):
        raise StoreError("keys must be non-empty strings")
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(key for key in keys if key in seen or seen.add(key))
        raise StoreError(f"duplicate key {dup!r} within one add() call")
    return keys


KEY_SEGMENTS_REFUSED = ("", ".", "..")
"""'/'-separated segments a new key may not have. A key is a URL path on the HTTP API
(`GET /v1/items/{key}`): clients remove dot segments from a URL before sending it
(RFC 3986 5.2.4; httpx sends `/v1/items/v/.` as `/v1/items/v`, curl as `/v1/items/v/`,
both send `.../a/../b` as `.../b`), and proxies merge empty ones (`a//b`), so such an
item could not be read or deleted by its key, and a request for it could reach another
item (an httpx DELETE of `v/.` deletes `v`)."""


def key_problem(key: str) -> str | None:
    """Why `key` cannot name a new item (None: it can): a segment in
    KEY_SEGMENTS_REFUSED. One leading '/' is not an empty segment: a CSV list's key is
    its path as written, often absolute, and clients send `/v1/items//data/x.jpg` as it
    is. Checked where items are added (the service, `build` and `add`), not when an
    index opens or an item is removed, so an index holding such keys from an earlier
    version still opens and `vitrieval-index remove` deletes them."""
    for segment in key.removeprefix("/").split("/"):
        if segment in KEY_SEGMENTS_REFUSED:
            what = "an empty '/'-separated segment" if not segment else f"a {segment!r} segment"
            return (
                f"a key cannot have {what}: HTTP clients rewrite such paths (dot segments "
                "are resolved, empty ones merged), so the item could not be read or deleted "
                "by key; a key's '/'-separated segments (after one leading '/') must not be "
                "empty, '.' or '..'"
            )
    return None


def check_new_keys(keys: Iterable[str], where: str = "") -> None:
    """StoreError (prefixed with `where`) naming the first key `key_problem` refuses."""
    for key in keys:
        problem = key_problem(key)
        if problem:
            raise StoreError(f"{where}key {key!r}: {problem}")


def check_ids(ids: Any, n: int, next_id: int) -> np.ndarray:
    """Item ids for n new items: `ids` when given (n increasing integers, the first at
    least `next_id`), otherwise next_id, next_id + 1, ..."""
    if ids is None:
        return np.arange(next_id, next_id + n, dtype=np.int64)
    x = np.asarray(ids)
    if x.shape != (n,) or (n and not np.issubdtype(x.dtype, np.integer)):
        raise StoreError(f"ids must be {n} integers, got shape {x.shape} of {x.dtype}")
    x = x.astype(np.int64)
    if n and (x[0] < next_id or (np.diff(x) <= 0).any()):
        raise StoreError(f"ids must increase and start at {next_id} or later")
    return x


def checked_items(
    keys: Sequence[str],
    vectors: Any,
    dim: int,
    labels: Sequence[Any] | None = None,
    paths: Sequence[Any] | None = None,
    metadata: Sequence[Any] | None = None,
) -> tuple[list[str], np.ndarray, list[str | None], list[str | None], list[str]]:
    """Everything an add checks before it changes anything: (keys, float32 (n, dim)
    unit vectors, labels, paths, metadata JSON texts). The journal's repair asks the
    same of each row it replays."""
    keys = check_keys(keys)
    x = as_matrix(vectors, dim, "vectors")
    if len(x) != len(keys):
        raise StoreError(f"{len(keys)} keys but {len(x)} vectors")
    check_unit(x)
    n = len(keys)
    return (
        keys,
        x,
        text_column(labels, n, "labels"),
        text_column(paths, n, "paths"),
        (metadata_column(metadata, n)),
    )
