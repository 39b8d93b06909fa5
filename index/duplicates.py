"""Near-duplicate groups of a catalogue: every pair of items scoring at least a threshold,
grouped as connected components (single linkage), each group with the item to keep.

The index is read in key order (`scroll`), a batch at a time: each item's neighbours
scoring at least the threshold are searched (k = NEIGHBOURS, read deeper while all k
are above it), and each pair is kept once (its keys in order). Memory holds the pairs
found and the union-find over their keys, not the catalogue. A pair is found from
either side: an approximate index that misses b near a but finds a near b still
links them.

Resumable: after every batch, its pairs and the key it ended at are appended to a
state file (one JSON line, flushed and fsynced); a run killed at any point and started
again with the same state file replays those lines (a torn last line is ignored) and
goes on after the last key recorded, to the same groups an uninterrupted run of the
unchanged index finds. Items removed in between drop out of the groups; an item added
in between whose key sorts before where the run stopped is searched only from the
other side (its pairs with items after the cursor). The state file's first line
records the index (its folder and creation time), the threshold and the filter: a run
with any of them different starts over.

Which item a group keeps (KEEP_RULES): "largest" (the most pixels of its image file,
then the largest file), "oldest" (the earliest modified image file) or
"metadata:FIELD" (the largest number in that metadata field, a dot path); items that
lack what the rule reads come last, and ties go to the smallest key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .contract import stored_vectors
from .json_text import parse_json
from .store import StoreError
from .store.request import MAX_DEPTH, Query, Where, checked_threshold

NEIGHBOURS = 32
"""Neighbours searched per item at first; read deeper while all are above the threshold."""
BATCH = 256
KEEP_RULES = ("largest", "oldest", "metadata:FIELD")
DEFAULT_KEEP = "largest"

Pair = tuple[str, str, float]


@dataclass
class DuplicateGroup:
    """One group: its keys (sorted), the suggested `keep`, and the pairs that link it
    (each (key, key, score), keys in order) with the best score among them."""

    keys: list[str]
    keep: str
    pairs: list[Pair]

    def as_json(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "keep": self.keep,
            "size": len(self.keys),
            "best_score": max(score for _, _, score in self.pairs),
            "pairs": [list(pair) for pair in self.pairs],
        }


def check_keep_rule(rule: str) -> str:
    if rule in ("largest", "oldest") or (
        rule.startswith("metadata:") and len(rule) > len("metadata:")
    ):
        return rule
    raise StoreError(f"keep must be one of {', '.join(KEEP_RULES)}, not {rule!r}")


def find_duplicates(
    store: Any,
    threshold: float,
    *,
    filter: Any = None,
    keep: str = DEFAULT_KEEP,
    state: Path | None = None,
    batch: int = BATCH,
    progress: Callable[[int], None] | None = None,
) -> list[DuplicateGroup]:
    """The near-duplicate groups of the items `filter` allows in an opened `store`
    (module docstring), largest groups first; `state` makes the run resumable."""
    keep = check_keep_rule(keep)
    where = Where(filter=filter)
    threshold = checked_threshold(threshold)
    if not -1.0 <= threshold <= 1.0:  # unit vectors: a threshold outside finds nothing
        raise StoreError(f"threshold must be a cosine, from -1 to 1, got {threshold:g}")
    info = store.info()  # the index itself: another one (or one made again) starts over
    header = {"index": str(Path(info["directory"]).resolve()), "created": info.get("created"),
              "threshold": threshold, "filter": _jsonable(filter)}  # fmt: skip
    pairs, after = _replay(state, header)
    done = 0
    with _appender(state, header, fresh=after is None and not pairs) as record:
        while True:
            page = store.scroll(where.allowed, batch, after)
            if not page.items:
                break
            keys = [item.key for item in page.items]
            found = _pairs_of(store, keys, where, threshold)
            for pair, score in found.items():  # found from either side: the best score
                pairs[pair] = max(score, pairs.get(pair, score))
            after = keys[-1]
            record({"after": after, "pairs": [[a, b, s] for (a, b), s in found.items()]})
            done += len(keys)
            if progress is not None:
                progress(done)
            if page.next is None:
                break
    return _groups(store, pairs, keep)


def _pairs_of(store: Any, keys: list[str], where: Where, threshold: float) -> dict:
    """{(a, b): score} of `keys`' neighbours at or above `threshold` (a < b); keys
    removed since they were listed (a server deletes beside a job) are skipped."""
    stored = stored_vectors(store, keys)
    keys = [key for key, vector in zip(keys, stored, strict=True) if vector is not None]
    if not keys:
        return {}
    vectors = np.stack([vector for vector in stored if vector is not None])
    found: dict[tuple[str, str], float] = {}
    pending = np.arange(len(keys))
    k = NEIGHBOURS
    while pending.size:
        query = Query(vectors[pending], k + 1, where, score_threshold=threshold)
        rows = store.ranked_search(query)
        deeper = []
        for row, hits in zip(pending.tolist(), rows, strict=True):
            for _, hit in hits:
                if hit.key != keys[row]:
                    pair = (min(hit.key, keys[row]), max(hit.key, keys[row]))
                    found[pair] = max(found.get(pair, -np.inf), float(hit.score))
            if len(hits) == k + 1 and k + 1 < MAX_DEPTH:
                deeper.append(row)
        pending = np.asarray(deeper, dtype=np.int64)
        k = min(MAX_DEPTH - 1, k * 4)
    return found


def _groups(store: Any, pairs: dict[tuple[str, str], float], keep: str) -> list[DuplicateGroup]:
    # a resumed run's earlier pairs may name items removed since: they link nothing now
    gone = {key for pair in pairs for key in pair if key not in store}
    pairs = {(a, b): s for (a, b), s in pairs.items() if a not in gone and b not in gone}
    root = single_linkage(pairs)
    members: dict[str, list[str]] = {}
    for key, r in root.items():
        members.setdefault(r, []).append(key)
    edges: dict[str, list[Pair]] = {}
    for (a, b), score in sorted(pairs.items()):
        edges.setdefault(root[a], []).append((a, b, score))
    groups = [
        DuplicateGroup(sorted(keys), _keep(store, sorted(keys), keep), edges[r])
        for r, keys in members.items()
    ]
    return sorted(groups, key=lambda g: (-len(g.keys), g.keys[0]))


def single_linkage(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Each key of `pairs` -> the smallest key of its connected component (union-find
    with path halving)."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]  # path halving
            key = parent[key]
        return key

    for a, b in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {key: root(key) for key in list(parent)}


def _keep(store: Any, keys: list[str], rule: str) -> str:
    """The key `rule` keeps among `keys` (sorted): the best by the rule, then the
    smallest key; items that lack what the rule reads come last."""
    records = {key: store.get(key) for key in keys}

    def rank(key: str) -> tuple:
        record = records[key]
        if record is None:  # removed since the pairs were found
            return (2, 0, key)
        if rule.startswith("metadata:"):
            value = record.metadata
            for part in rule.split(":", 1)[1].split("."):
                value = value.get(part) if isinstance(value, dict) else None
            number = isinstance(value, int | float) and not isinstance(value, bool)
            return (0, -float(value), key) if number else (1, 0.0, key)
        path = Path(record.path) if record.path else None
        if path is None or not path.is_file():
            return (1, 0, key)
        if rule == "oldest":
            return (0, path.stat().st_mtime_ns, key)
        return (0, -_pixels(path), -path.stat().st_size, key)

    return min(keys, key=rank)


def _pixels(path: Path) -> int:
    from PIL import Image

    try:
        with Image.open(path) as image:  # reads the header only
            return image.width * image.height
    except (OSError, ValueError):
        return 0


def _jsonable(filter: Any) -> Any:
    return json.loads(json.dumps(filter, default=str)) if filter is not None else None


def _replay(state: Path | None, header: dict) -> tuple[dict, str | None]:
    """The pairs and the last key a state file recorded (none when it is missing, of
    another run, or holds no complete batch)."""
    if state is None or not state.exists():
        return {}, None
    lines = state.read_text(encoding="utf-8").split("\n")
    try:
        if parse_json(lines[0]) != header:
            return {}, None
    except ValueError:
        return {}, None
    pairs: dict[tuple[str, str], float] = {}
    after = None
    for line in lines[1:]:
        try:
            entry = parse_json(line)
        except ValueError:
            break  # a torn last line: that batch is searched again
        pairs.update({(a, b): s for a, b, s in entry["pairs"]})
        after = entry["after"]
    return pairs, after


class _appender:
    """A context manager appending one durable JSON line per batch to the state file."""

    def __init__(self, state: Path | None, header: dict, fresh: bool) -> None:
        self.state, self.header, self.fresh = state, header, fresh

    def __enter__(self) -> Callable[[dict], None]:
        if self.state is None:
            return lambda _entry: None
        if self.fresh or not self.state.exists():
            self.state.write_text(json.dumps(self.header) + "\n", encoding="utf-8")
        else:
            _drop_torn_line(self.state)
        self.file = self.state.open("a", encoding="utf-8")

        def record(entry: dict) -> None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())

        return record

    def __exit__(self, *exc: object) -> None:
        if self.state is not None:
            self.file.close()


def _drop_torn_line(state: Path) -> None:
    """Cut a state file after its last complete line (a kill may leave half of one)."""
    data = state.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with state.open("r+b") as fh:
            fh.truncate(end)


def iter_csv_rows(groups: list[DuplicateGroup]) -> Iterator[list[Any]]:
    """group number, key, whether it is the one to keep, its best score in the group."""
    yield ["group", "key", "keep", "best_score"]
    for n, group in enumerate(groups, 1):
        best: dict[str, float] = {}
        for a, b, score in group.pairs:
            best[a] = max(best.get(a, -1.0), score)
            best[b] = max(best.get(b, -1.0), score)
        for key in group.keys:
            yield [n, key, key == group.keep, round(best[key], 6)]
