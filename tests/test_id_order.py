"""A sealed segment's rows in ascending id order (index/store/_id_order.py): merges of
segments whose id ranges interleave keep it, writing out of order is refused, and a
segment written out of order (as an older version's merge could) is still read right."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from store_helpers import as_pairs, brute_force, exact_vectors

from vitrieval.index.store import IndexStore, StoreError, _persist, _sealed_segment
from vitrieval.index.store._id_order import check_ascending, merged_by_id
from vitrieval.index.store._sealed_segment import write_segment
from vitrieval.index.store._state import StoreState


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


def store_of(
    tmp_path, sizes: tuple[int, ...], labels_near: int, merge_after: tuple[int, ...]
) -> tuple[IndexStore, np.ndarray, np.ndarray]:
    """A Flat store saved in batches of `sizes` rows (each save a segment), its due
    merges run after the saves `merge_after` counts (those may join segments that are
    not neighbours), then merged whole and opened again."""
    x = exact_vectors(np.random.default_rng(8), sum(sizes), 8)
    i = np.arange(len(x))
    # every 997th item, and all of them near both ends, where rows out of order sit
    few = (i % 997 == 0) | (i < labels_near) | (i >= len(x) - labels_near)
    labels = np.where(few, "few", "many")
    store = IndexStore.create(tmp_path / "index", dim=8, factory="Flat")
    starts = itertools.accumulate((0, *sizes[:-1]))
    for saves, (start, size) in enumerate(zip(starts, sizes, strict=True), 1):
        part = slice(start, start + size)
        keys = [str(i) for i in range(start, start + size)]
        store.add(keys, x[part], labels=labels[part].tolist())
        store.save()
        if saves in merge_after:
            store.merge()
    store.merge(everything=True)
    assert len(store.info()["segments"]) == 1
    store.close()
    return IndexStore.open(tmp_path / "index"), x, labels


def check_exact_reads(store: IndexStore, x: np.ndarray, labels: np.ndarray) -> None:
    # a filter this narrow is searched exactly, over the vectors read for its items
    q = x[[3, 12, 150, len(x) - 3, 997, len(x) // 2]]
    got = as_pairs(store.search(q, 5, label="few"))
    assert got == brute_force(q, x, 5, allowed=labels == "few")


def test_a_merge_of_interleaved_segments_writes_its_rows_in_id_order(tmp_path) -> None:
    # the saves merge the four small segments into one of 40 whose ids straddle the
    # large one's; merging everything then meets interleaving id ranges
    store, x, labels = store_of(tmp_path, (10, 45_000, 10, 10, 10), 60, (4, 5))
    check_exact_reads(store, x, labels)


@pytest.mark.parametrize(
    ("sizes", "merge_after"),
    [
        ((10, 45_000, 10, 10, 10), (4, 5)),  # most rows out of place
        ((10, 100, 10, 10, 10, 45_000), (5,)),  # 130 rows out of place, both ends in place
    ],
)
def test_a_segment_an_older_merge_wrote_out_of_id_order_is_read_right(
    tmp_path, monkeypatch, sizes, merge_after
) -> None:
    # as an older version wrote it: one segment after another, no check, no mark
    def chained(streams, bounds):
        return itertools.chain.from_iterable(streams)

    def unmarked(*args, **kwargs):
        return dataclasses.replace(write_segment(*args, **kwargs), rows_in_id_order=False)

    monkeypatch.setattr(_persist, "merged_by_id", chained)
    monkeypatch.setattr(_persist, "write_segment", unmarked)
    monkeypatch.setattr(_sealed_segment, "check_ascending", lambda ids, after: None)
    monkeypatch.setattr(StoreState, "due_merge", lambda self: False)  # merged when told
    store, x, labels = store_of(tmp_path, sizes, 200, merge_after)
    check_exact_reads(store, x, labels)
