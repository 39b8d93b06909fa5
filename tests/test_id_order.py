"""A sealed segment's rows in ascending id order (index/store/_id_order.py): merges of
segments whose id ranges interleave keep it, writing out of order is refused, and a
segment written out of order (as an older version's merge could) is still read right."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from store_helpers import as_pairs, brute_force, exact_vectors

from vitrieval.index.store import IndexStore, StoreError, _persist, _sealed_segment
from vitrieval.index.store._id_order import check_ascending, merged_by_id

SIZES = (10, 45_000, 10, 10, 10)  # the saves merge the four small ones into one of 40


def stream(ids: list[int], batch: int = 3) -> list[tuple[list[tuple], np.ndarray]]:
    rows = [(i, f"k{i}", None, None, "{}") for i in ids]
    vectors = np.asarray(ids, np.float32)[:, None]
    return [(rows[s : s + batch], vectors[s : s + batch]) for s in range(0, len(ids), batch)]


def flat(batches) -> tuple[list[int], list[float]]:
    pairs = [
        (row[0], float(v[0]))
        for rows, vectors in batches
        for row, v in zip(rows, vectors, strict=True)
    ]
    return [i for i, _ in pairs], [v for _, v in pairs]


def test_interleaved_streams_are_merged_by_id_and_disjoint_ones_chained() -> None:
    a, b, c = [0, 1, 2, 9, 10], [3, 4, 5, 6], [7, 8, 11]
    ids, values = flat(merged_by_id([stream(a), stream(b), stream(c)], [(0, 10), (3, 6), (7, 11)]))
    assert ids == list(range(12)) and values == [float(i) for i in ids]  # rows keep their vectors
    first, second = stream([5, 6]), stream([0, 1])
    chained = merged_by_id([first, second, []], [(5, 6), (0, 1), None])
    assert list(chained) == second + first  # the batches themselves, in range order


def test_rows_out_of_id_order_are_refused() -> None:
    check_ascending(np.asarray([4, 5, 9]), 3)
    for ids, after in (([4, 4], None), ([5, 4], None), ([4, 5], 4)):
        with pytest.raises(StoreError, match="ascending id order"):
            check_ascending(np.asarray(ids), after)


def interleaved_store(tmp_path) -> tuple[IndexStore, np.ndarray, np.ndarray]:
    """Segments of 40 and 45,000 rows whose id ranges interleave, merged into one."""
    x = exact_vectors(np.random.default_rng(8), sum(SIZES), 8)
    i = np.arange(len(x))
    # every 997th item, and all of them near both ends, where rows out of order sit
    labels = np.where((i % 997 == 0) | (i < 60) | (i >= 44_990), "few", "many")
    store = IndexStore.create(tmp_path / "index", dim=8, factory="Flat")
    for start, size in zip(itertools.accumulate((0, *SIZES[:-1])), SIZES, strict=True):
        part = slice(start, start + size)
        keys = [str(i) for i in range(start, start + size)]
        store.add(keys, x[part], labels=labels[part].tolist())
        store.save()
    assert [s["rows"] for s in store.info()["segments"]] == [40, 45_000]
    assert store.merge(everything=True) == 2
    store.close()
    return IndexStore.open(tmp_path / "index"), x, labels


def check_exact_reads(store: IndexStore, x: np.ndarray, labels: np.ndarray) -> None:
    # a filter this narrow is searched exactly, over the vectors read for its items
    q = x[[3, 12, 45_012, 45_003, 997, 20_000]]
    got = as_pairs(store.search(q, 5, label="few"))
    assert got == brute_force(q, x, 5, allowed=labels == "few")


def test_a_merge_of_interleaved_segments_writes_its_rows_in_id_order(tmp_path) -> None:
    store, x, labels = interleaved_store(tmp_path)
    check_exact_reads(store, x, labels)


def test_a_segment_written_out_of_id_order_is_read_right(tmp_path, monkeypatch) -> None:
    # as a merge of an older version wrote it: one segment after another
    def chained(streams, bounds):
        return itertools.chain.from_iterable(streams)

    monkeypatch.setattr(_persist, "merged_by_id", chained)
    monkeypatch.setattr(_sealed_segment, "check_ascending", lambda ids, after: None)
    store, x, labels = interleaved_store(tmp_path)
    check_exact_reads(store, x, labels)
