"""Filters answered from a sealed segment's columns (index/store/_columns.py, written
with the segment) equal the field index's answers and the reference rule
(`filters.Range.holds`, `filters.Match.holds`)."""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import unit_vectors

from vitrieval.index.store import IndexStore
from vitrieval.index.store import _field_index as fx
from vitrieval.index.store import manifest as mf
from vitrieval.index.store._columns import EXACT_FLOAT_INTEGERS, read_columns
from vitrieval.index.store.filters import Match, Range, field_values, parse_filter

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
    meta["colour"] = ["red", "blue", "green", True, False][i % 5]
    meta["big"] = 2**53 + i if i % 3 == 0 else i
    return meta


@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> tuple[IndexStore, list[dict]]:
    rng = np.random.default_rng(3)
    metadata = [_metadata(rng, i) for i in range(N)]
    store = IndexStore.create(
        tmp_path_factory.mktemp("columns") / "idx",
        dim=8,
        factory="Flat",
        filter_fields=["big", "colour", "price", "shop.rating", "sizes"],
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


def _reference(metadata: list[dict], leaf: Match | Range) -> list[str]:
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
    # a single number per item has a column; a list of numbers stays with the field index
    assert (path in segment.columns.numbers) is columned
    rng = np.random.default_rng(len(path))
    for bounds in _ranges(rng, 60):
        leaf = parse_filter({"must": [{"key": path, "range": bounds}]}).must[0]
        found = segment.filter_ids(leaf)
        assert np.all(found[1:] > found[:-1])  # sorted, unique
        assert _keys(store, found) == _reference(metadata, leaf), bounds
        assert np.array_equal(found, fx.index_ids(segment._db, leaf)), bounds
        from_column = segment.columns.ids_in(leaf)
        assert (from_column is not None) is columned  # answered from the column
        if columned:
            assert np.array_equal(from_column, found), bounds


def test_matches_on_text_and_booleans_come_from_a_text_column(sealed) -> None:
    store, metadata = sealed
    segment = store._state.sealed[0]
    assert "colour" in segment.columns.texts and "colour" not in segment.columns.numbers
    for values in (["red"], [True], [False, "blue"], ["purple"], [1], ["true"], [True, 1]):
        leaf = parse_filter({"must": [{"key": "colour", "match": {"any": values}}]}).must[0]
        found = segment.filter_ids(leaf)
        assert _keys(store, found) == _reference(metadata, leaf), values
        assert np.array_equal(found, fx.index_ids(segment._db, leaf)), values
        # strings and booleans from the column; a match on a number from the field index
        numeric = any(not isinstance(v, str | bool) for v in values)
        assert (segment.columns.ids_in(leaf) is None) is numeric, values


def test_integers_are_compared_exactly_and_huge_ones_keep_the_field_index(sealed) -> None:
    """float64 holds every integer within 2**53 exactly: a column of such a path
    compares exactly; a path holding a larger integer has no column (its values would
    round), and a bound float64 rounds is answered by the field index."""
    store, metadata = sealed
    segment = store._state.sealed[0]
    assert "big" not in segment.columns.numbers  # 2**53 + i for some items
    for bounds in ({"gt": 2**53}, {"gte": 2**53 + 3}, {"lt": 2**53 + 1}, {"lte": float(2**53)}):
        leaf = parse_filter({"must": [{"key": "big", "range": bounds}]}).must[0]
        assert _keys(store, segment.filter_ids(leaf)) == _reference(metadata, leaf), bounds
    price = segment.columns.numbers["price"]
    for bound in (10, 10.0, 9.9, 2**53, EXACT_FLOAT_INTEGERS):
        leaf = parse_filter({"must": [{"key": "price", "range": {"gte": bound}}]}).must[0]
        assert _keys(store, price.ids_in(leaf)) == _reference(metadata, leaf), bound
    rounded = parse_filter({"must": [{"key": "price", "range": {"lt": 2**53 + 1}}]}).must[0]
    assert price.ids_in(rounded) is None  # float64 would round the bound
    assert _keys(store, segment.filter_ids(rounded)) == _reference(metadata, rounded)


def test_paths_outside_the_field_index_and_the_label_have_no_column(sealed) -> None:
    store, _ = sealed
    segment = store._state.sealed[0]
    names = set(segment.columns.numbers) | set(segment.columns.texts)
    assert names == {"colour", "price", "shop.rating"}
    for key in ("unindexed", "label"):
        leaf = parse_filter({"must": [{"key": key, "range": {"gt": 1}}]}).must[0]
        assert segment.columns.ids_in(leaf) is None


def test_the_columns_file_is_listed_and_read_back(sealed) -> None:
    store, _ = sealed
    segment = store._state.sealed[0]
    name = mf.segment_columns_file(segment.number)
    assert name in segment.entry.files
    again = read_columns(store.directory / name)
    for path, column in segment.columns.numbers.items():
        assert np.array_equal(again.numbers[path].ids, column.ids)
        assert np.array_equal(again.numbers[path].values, column.values)
