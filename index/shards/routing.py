"""How a sharded index routes work to its shards and puts their answers together,
written once for `ShardedStore` (shards in this process) and the Ray ingress's
`RemoteIndex` (shards in replicas elsewhere).

- key -> shard: `layout.shard_of` (the rule in shards.json); `layout.split_by_shard` groups keys;
- item numbering: every add takes the next ids of the whole index (`numbered`), so
  equal scores order by id, insertion order, exactly as in one store;
- a search: every shard gets the query with its own part of the left-out keys
  (`shard_queries`); their top k merge into one (`merge_ranked`: descending score,
  equal scores by ascending item id);
- per-key reads and labelled items put back in the caller's order (`in_key_order`,
  `merge_labelled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..store import Hit, ScrollPage, StoreError
from ..store.request import Query, Ranked
from .layout import split_by_shard

T = TypeVar("T")

NO_DBA = (
    "a sharded index has no DBA vectors: DBA needs every item's neighbours in the whole "
    "index, which its shards do not see"
)


def no_dba_error(directory: Path) -> StoreError:
    """What a sharded index answers to a search against DBA vectors (its shards would
    each blame themselves, naming their folders)."""
    return StoreError(f"{directory}: {NO_DBA}", public=f"this index is sharded, and {NO_DBA}")


def shard_queries(query: Query, shards: int, directory: Path, sharded: bool = True) -> list[Query]:
    """`query` as each of `shards` shards runs it: with the left-out keys it owns.
    A sharded index refuses a search against DBA vectors (`no_dba_error`); a single
    store served as one shard (`sharded` False) answers it itself."""
    if query.where.augmented and sharded:
        raise no_dba_error(directory)
    query = query.unpaged()  # each shard's top k + offset; the merge cuts the page
    exclude = list(query.where.exclude_keys)
    if not exclude:
        return [query] * shards
    owned = split_by_shard(exclude, shards)
    return [query.excluding([exclude[i] for i in owned.get(n, [])]) for n in range(shards)]


def numbered(next_id: int, count: int) -> np.ndarray:
    """int64 (count,) item ids for an add of `count` items, from the index's next id."""
    return np.arange(next_id, next_id + count, dtype=np.int64)


def in_key_order(
    count: int, owned: dict[int, list[int]], answers: Sequence[Sequence[T]]
) -> list[T | None]:
    """Each shard's per-key answers (in `owned`'s order of shards) put back at their
    keys' positions among `count` keys."""
    out: list[T | None] = [None] * count
    for positions, found in zip(owned.values(), answers, strict=True):
        for i, value in zip(positions, found, strict=True):
            out[i] = value
    return out


def merge_ranked(per_shard: Sequence[Sequence[Sequence[tuple[int, Hit]]]], query: Query) -> Ranked:
    """Each shard's ranked top k + offset (per query, the answer to `shard_queries`'
    query) merged into `query`'s page: descending score, equal scores by ascending item
    id (ids are numbered across the shards, so this is the order one store would give)."""
    merged: Ranked = [[] for _ in range(len(per_shard[0]) if per_shard else 0)]
    for found in per_shard:
        for row, hits in zip(merged, found, strict=True):
            row.extend(hits)
    for row in merged:
        row.sort(key=lambda pair: (-pair[1].score, pair[0]))
    return query.page(merged)


def merge_scrolled(pages: Sequence[ScrollPage], limit: int) -> ScrollPage:
    """Each shard's `scroll` page (its first `limit` keys after the same cursor) merged
    into the index's: the first `limit` keys of them all, and a next cursor when any
    shard had more or the merge left some out (a key lives in one shard)."""
    merged = sorted((item for page in pages for item in page.items), key=lambda i: i.key)
    items = merged[:limit]
    more = len(merged) > limit or any(page.next is not None for page in pages)
    return ScrollPage(items, items[-1].key if more and items else None)


def merge_labelled(
    parts: Sequence[tuple[list[str], list[str], np.ndarray]],
    ids: Sequence[dict[str, int]],
    dim: int,
    limit: int | None = None,
) -> tuple[list[str], list[str], np.ndarray]:
    """Each shard's `labelled_items` with the item ids of its keys, as one (keys, labels,
    float32 (n, dim) vectors) in insertion (id) order, as one store lists them; more
    than `limit` items in all is a StoreError."""
    n = sum(len(part[0]) for part in parts)
    if limit is not None and n > limit:
        raise StoreError(f"the index holds {n} labelled items, more than the {limit} allowed")
    order = sorted(
        (ids[i][key], i, j) for i, part in enumerate(parts) for j, key in enumerate(part[0])
    )
    keys = [parts[i][0][j] for _, i, j in order]
    labels = [parts[i][1][j] for _, i, j in order]
    vectors = np.stack([parts[i][2][j] for _, i, j in order]) if order else np.empty((0, dim))
    return keys, labels, vectors.astype(np.float32, copy=False)
