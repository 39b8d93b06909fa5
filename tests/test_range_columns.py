"""Range filters from a sealed segment's numeric columns (index/store/columns.py) equal
the field index's answers and the reference rule (`filters.Range.holds`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from store_helpers import unit_vectors

from index.filters import parse_filter
from index.store import IndexStore
from index.store import columns as columns_module
from index.store import fields as fx
from index.store.columns import COLUMN_AFTER_RANGES, RangeColumns
from index.store.filters import Range, field_values

N = 600


def _metadata(rng: np.random.Generator, i: int) -> dict:
    """Integers, floats, text and booleans under one key, items without it, a nested
    number and a list of numbers."""
    kind = i % 10
    price: object = int(rng.integers(0, 50)) if kind < 5 else round(float(rng.uniform(0, 50)), 1)
    if kind == 7:
        price = "n/a"
    elif kind == 8:
        price = bool(i % 20 == 8)
    meta: dict = {"shop": {"rating": float(rng.integers(0, 11)) / 2}}
    if kind != 9:
        meta["price"] = price
    meta["sizes"] = [int(s) for s in rng.integers(30, 50, size=int(rng.integers(0, 4)))]
    meta["unindexed"] = int(rng.integers(0, 50))
    return meta


@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> tuple[IndexStore, list[dict]]:
    rng = np.random.default_rng(3)
    metadata = [_metadata(rng, i) for i in range(N)]
    store = IndexStore.create(
        tmp_path_factory.mktemp("columns") / "idx",
        dim=8,
        factory="Flat",
        filter_fields=["price", "shop.rating", "sizes"],
    )
    store.add([f"k{i}" for i in range(N)], unit_vectors(rng, N, 8), metadata=metadata)
    store.save()
    yield store, metadata
    store.close()


def _ranges(rng: np.random.Generator, count: int) -> list[dict]:
    """Random bounds: on values items have (edges), between them, and open ends."""
    out = []
    for _ in range(count):
        bounds = {}
        for op in rng.permutation(["gt", "gte", "lt", "lte"])[: rng.integers(1, 3)]:
            bounds[str(op)] = (
                float(rng.integers(0, 50)) if rng.random() < 0.5 else rng.uniform(-5, 55)
            )
        out.append(bounds)
    return out


def _reference(metadata: list[dict], leaf: Range) -> list[str]:
    return sorted(
        f"k{i}" for i, m in enumerate(metadata) if leaf.holds(field_values(leaf.field, None, m))
    )


def _keys(store: IndexStore, ids: np.ndarray) -> list[str]:
    by_id = dict(store._state.sealed[0].keys_by_id())
    return sorted(by_id[int(i)] for i in ids)


@pytest.mark.parametrize(
    ("path", "columned"), [("price", True), ("shop.rating", True), ("sizes", False)]
)
def test_ranges_equal_the_field_index_and_the_reference(sealed, path, columned) -> None:
    store, metadata = sealed
    segment = store._state.sealed[0]
    rng = np.random.default_rng(len(path))
    for bounds in _ranges(rng, 60):
        leaf = parse_filter({"must": [{"key": path, "range": bounds}]}).must[0]
        found = segment.filter_ids(leaf)
        assert np.all(found[1:] > found[:-1])  # sorted, unique
        assert _keys(store, found) == _reference(metadata, leaf), bounds
        index_read = fx.leaf_ids(segment._db, leaf, segment.fields, "test")
        assert np.array_equal(found, index_read), bounds
    # a single number per item: read as a column; a list of numbers: the field index
    columns = segment._range_columns._columns
    assert (columns.get(path) is not None) is columned, columns.keys()


def test_one_range_however_repeated_stays_with_the_field_index(sealed) -> None:
    store, _ = sealed
    segment = store._state.sealed[0]
    columns = RangeColumns(segment._db, segment.fields)
    leaf = parse_filter({"must": [{"key": "price", "range": {"gte": 10}}]}).must[0]
    for _ in range(3):
        assert columns.ids_in(leaf) is None
    other = parse_filter({"must": [{"key": "price", "range": {"lt": 10}}]}).must[0]
    assert COLUMN_AFTER_RANGES == 2 and columns.ids_in(other) is not None
    # paths outside the field index and the label never get a column
    for key in ("unindexed", "label"):
        for bounds in ({"gt": 1}, {"gt": 2}, {"gt": 3}):
            leaf = parse_filter({"must": [{"key": key, "range": bounds}]}).must[0]
            assert columns.ids_in(leaf) is None


def test_columns_stay_within_their_budget(sealed, monkeypatch) -> None:
    """The first path to vary keeps its column; one that no longer fits stays with the
    field index for good (no re-reading), and every answer stays right."""
    store, metadata = sealed
    segment = store._state.sealed[0]

    def rows(path: str) -> int:
        leaf = parse_filter({"must": [{"key": path, "range": {"gte": -1}}]}).must[0]
        return len(fx.leaf_ids(segment._db, leaf, segment.fields, "t"))

    price_rows, rating_rows = rows("price"), rows("shop.rating")
    assert price_rows + rating_rows > N >= max(price_rows, rating_rows)
    columns = RangeColumns(segment._db, segment.fields, budget_rows=N)  # room for one
    reads = []
    real_read = columns_module.read_column

    def counted_read(db, path, max_rows):
        reads.append(path)
        return real_read(db, path, max_rows)

    monkeypatch.setattr(columns_module, "read_column", counted_read)
    rng = np.random.default_rng(9)
    for path in ("price", "shop.rating", "price", "shop.rating"):
        for bounds in _ranges(rng, 3):
            leaf = parse_filter({"must": [{"key": path, "range": bounds}]}).must[0]
            found = columns.ids_in(leaf)
            if path == "shop.rating":
                assert found is None
            if found is not None:
                assert _keys(store, found) == _reference(metadata, leaf)
    assert reads == ["price", "shop.rating"]  # each read once, the second one kept out
    # a read stops one row past the room it is given
    assert real_read(segment._db, "price", price_rows - 1) is None
    assert real_read(segment._db, "price", price_rows).ids.size == price_rows
    assert list(columns._columns) == ["price"] and columns._rows == price_rows


def test_a_column_answer_enters_the_leaf_cache_only_when_asked_again(sealed) -> None:
    """A column's answer enters the leaf cache only when its range is asked again: a
    slider's one-off ranges would push out conditions that cost a scan."""
    store, _ = sealed
    segment = store._state.sealed[0]
    leaves = [
        parse_filter({"must": [{"key": "shop.rating", "range": bounds}]}).must[0]
        for bounds in ({"gt": 3.25}, {"lt": 1.75}, {"gte": 2.25, "lte": 4.25})
    ]
    for leaf in leaves:
        segment.filter_ids(leaf)
    assert segment._range_columns._columns.get("shop.rating") is not None
    assert not any(leaf in segment._leaf_cache._entries for leaf in leaves[1:])
    # asked again, a column's answer is a condition that repeats: remembered
    assert np.array_equal(segment.filter_ids(leaves[1]), segment.filter_ids(leaves[1]))
    assert leaves[1] in segment._leaf_cache._entries


def test_a_column_is_read_once_while_searches_go_on(sealed, monkeypatch) -> None:
    """Searches on the path being read use the field index meanwhile (None), and the
    column is read once however many searches ask at the same time."""
    store, metadata = sealed
    segment = store._state.sealed[0]
    columns = RangeColumns(segment._db, segment.fields)
    reads, started, release = [], threading.Event(), threading.Event()
    real_read = columns_module.read_column

    def slow_read(db, path, max_rows):
        reads.append(path)
        started.set()
        release.wait(10)
        return real_read(db, path, max_rows)

    monkeypatch.setattr(columns_module, "read_column", slow_read)
    leaves = [
        parse_filter({"must": [{"key": "price", "range": {"gte": float(g)}}]}).must[0]
        for g in range(10)
    ]
    assert columns.ids_in(leaves[0]) is None  # the first distinct range
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(columns.ids_in, leaves[1])
        assert started.wait(10)
        assert [columns.ids_in(leaf) for leaf in leaves[2:]] == [None] * 8
        release.set()
        first = reading.result()
    assert reads == ["price"]
    for leaf in [leaves[1], *leaves[2:]]:
        found = first if leaf is leaves[1] else columns.ids_in(leaf)
        assert _keys(store, found) == _reference(metadata, leaf)
    assert reads == ["price"]
