"""Filters mean one thing whatever plan answers them: a differential test.

One catalogue of items whose metadata holds the values filters get wrong most easily
(booleans beside 0 and 1, -0.0, integers around 2**53 and at the int64 bounds, floats
that round to them, strings that look like numbers, lists, nulls, missing fields),
and random filters over the same values (hypothesis). Each filter is answered by the
filter language's own evaluation (`Filter.matches`, the reference rule) and by
searching every item of the catalogue through each plan the store has:

- the growing segment (in memory, not yet saved), exactly over the allowed subset
  and through the ID-selector search;
- sealed segments through the field index alone, through their columns (written
  with the segment; the field index answers what they do not), with remembered
  conditions, and through the widened ID-selector search instead of the exact
  subset;
- a sharded index built from a Parquet embeddings folder.

Every plan must give exactly the reference's items. The catalogues are built once per
test run; `--filter-cases N` runs N cases per plan instead of the default.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_shards import in_process

from vitrieval.index.pipeline.embeddings_folder import part_name, write_meta, write_part
from vitrieval.index.shards.build import build_sharded
from vitrieval.index.shards.store import open_index
from vitrieval.index.store import IndexStore
from vitrieval.index.store import _columns as column_module
from vitrieval.index.store import _field_index as field_module
from vitrieval.index.store import _filter_plans as filtering
from vitrieval.index.store._columns import read_columns
from vitrieval.index.store.filters import parse_filter

DIM = 4
N = 160
REMOVED = [f"i{n}" for n in range(0, N, 23)]
DEFAULT_CASES = 2000

NUMBERS = [
    0, 1, -1, 7, 0.0, -0.0, 1.0, 0.5, 1.5, -2.5,
    2**53 - 1, 2**53, 2**53 + 1, float(2**53), -(2**53) - 1, -float(2**53),
    2**62, 2**63 - 1, -(2**63), 9.2e18, -9.3e18, 1e300, -1e300,
]  # fmt: skip
"""Numbers of the catalogue and of the filters; beyond 2**53 an int is not a float."""
SMALL_NUMBERS = [n for n in NUMBERS if abs(n) <= 2**53]
"""A path holding only these gets a numeric column (columns.py)."""
OTHER_SCALARS = [True, False, "a", "b", "", "1", "true", "cat"]
SCALARS = NUMBERS + OTHER_SCALARS
BOUNDS = [*NUMBERS, 2**53 + 2, 0.25, 3, -1e-300]
KEYS = ["v", "n", "p", "o.x", "label", "metadata.label", "missing", "tags"]


def catalogue(rng: np.random.Generator) -> list[dict[str, Any]]:
    """N items: key, label, metadata (every field drawn from the edge values)."""

    def pick(pool: list) -> Any:
        return pool[int(rng.integers(len(pool)))]

    items = []
    for n in range(N):
        meta: dict[str, Any] = {}
        roll = rng.random()
        if roll < 0.6:
            meta["v"] = pick(SCALARS)
        elif roll < 0.7:
            meta["v"] = None
        elif roll < 0.85:
            meta["v"] = [pick(SCALARS) for _ in range(int(rng.integers(0, 4)))]
        if rng.random() < 0.85:
            meta["n"] = pick(NUMBERS)
        if rng.random() < 0.85:
            meta["p"] = pick(SMALL_NUMBERS)
        if rng.random() < 0.5:
            meta["o"] = {"x": pick(SCALARS)}
        if rng.random() < 0.3:
            meta["label"] = pick(OTHER_SCALARS)
        if rng.random() < 0.4:
            meta["tags"] = [pick(SCALARS) for _ in range(int(rng.integers(1, 3)))]
        label = pick(["cat", "dog", None])
        items.append({"key": f"i{n}", "label": label, "metadata": meta})
    return items


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def add_all(store: IndexStore, items: list[dict], x: np.ndarray) -> None:
    store.add(
        [i["key"] for i in items],
        x,
        labels=[i["label"] for i in items],
        metadata=[i["metadata"] for i in items],
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The catalogue and the stores answering it (one opened per sealed plan, so that
    each plan's remembered conditions and columns are its own)."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # 160 items: OpenMP's start-up would cost 10x the search
    rng = np.random.default_rng(25)
    items = catalogue(rng)
    x = unit(rng, N)
    root = tmp_path_factory.mktemp("differential")

    growing = IndexStore.create(root / "growing", dim=DIM, factory="Flat")
    add_all(growing, items, x)
    growing.remove(REMOVED)

    sealed_dir = root / "sealed"
    sealed = IndexStore.create(sealed_dir, dim=DIM, factory="Flat")
    half = N // 2
    add_all(sealed, items[:half], x[:half])
    sealed.save()
    add_all(sealed, items[half:], x[half:])
    sealed.remove(REMOVED)
    sealed.save()
    sealed.close()

    folder = root / "emb"
    for part, (a, b) in enumerate(itertools.pairwise((0, half, N))):
        write_part(
            folder / part_name(part),
            [i["key"] for i in items[a:b]],
            x[a:b],
            labels=[i["label"] for i in items[a:b]],
            metadata=[i["metadata"] for i in items[a:b]],
        )
    write_meta(folder, {"dim": DIM, "model_fingerprint": "f" * 64})
    build_sharded(folder, root / "sharded", "", "Flat", 2, 40, in_process)
    sharded = open_index(root / "sharded")
    sharded.remove(REMOVED)

    opened = {name: IndexStore.open(sealed_dir) for name in SEALED_PLANS}
    yield {"items": items, "growing": growing, "sharded": sharded, **opened}
    for store in (growing, sharded, *opened.values()):
        store.close()
    faiss.omp_set_num_threads(threads)


@contextlib.contextmanager
def patched(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set attributes for one answer (cheaper than pytest's monkeypatch per case)."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


NO_CACHE = [
    (field_module.LeafCache, "get", lambda self, leaf: None),
    (field_module.LeafCache, "put", lambda self, leaf, ids: None),
]
NO_COLUMNS = [(column_module.SegmentColumns, "ids_in", lambda self, leaf: None)]
WIDENED = [(filtering, "EXACT_SEARCH_MAX", 0), (filtering, "EXACT_SEARCH_MAX_FLAT", 0)]

SEALED_PLANS = {
    "sealed, field index": NO_CACHE + NO_COLUMNS,
    "sealed, columns": NO_CACHE,
    "sealed, remembered conditions": [],
    "sealed, widened search": WIDENED,
}
PLANS: dict[str, tuple[str, list]] = {
    "growing, exact subset": ("growing", []),
    "growing, widened search": ("growing", WIDENED),
    **{name: (name, changes) for name, changes in SEALED_PLANS.items()},
    "sharded": ("sharded", []),
}


def answer(store: Any, raw: dict, changes: list) -> set[str]:
    query = np.ones((1, DIM), dtype=np.float32) / np.sqrt(DIM)
    with patched(changes):
        (hits,) = store.search(query, N, filter=raw)
    return {h.key for h in hits}


def reference(items: list[dict], raw: dict) -> set[str]:
    flt = parse_filter(raw)
    return {
        i["key"]
        for i in items
        if i["key"] not in REMOVED and flt.matches(i["label"], i["metadata"])
    }


# -- the random filters --------------------------------------------------------------

scalars = st.sampled_from(SCALARS)
keys = st.sampled_from(KEYS)
matches = st.builds(lambda k, v: {"key": k, "match": v}, keys, scalars) | st.builds(
    lambda k, vs: {"key": k, "match": {"any": vs}}, keys, st.lists(scalars, min_size=1, max_size=3)
)
range_bounds = st.dictionaries(
    st.sampled_from(["gt", "gte", "lt", "lte"]), st.sampled_from(BOUNDS), min_size=1, max_size=2
)
ranges = st.builds(lambda k, r: {"key": k, "range": r}, keys, range_bounds)
leaves = matches | ranges


def filters_of(conditions: st.SearchStrategy) -> st.SearchStrategy:
    clause = st.lists(conditions, max_size=2)
    return st.builds(
        lambda must, should, must_not: {"must": must, "should": should, "must_not": must_not},
        clause,
        clause,
        clause,
    )


random_filters = filters_of(leaves | filters_of(leaves))


def cases(config: pytest.Config) -> int:
    return config.getoption("--filter-cases") or DEFAULT_CASES


def test_every_plan_answers_as_the_reference(stores, pytestconfig):
    """Each random filter through every plan (one draw serves them all: the draw costs
    more than an answer)."""

    @settings(
        max_examples=cases(pytestconfig),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(raw=random_filters)
    def check(raw: dict) -> None:
        expected = reference(stores["items"], raw)
        for plan, (store_name, changes) in PLANS.items():
            assert answer(stores[store_name], raw, changes) == expected, (plan, raw)

    check()


def test_the_catalogue_holds_the_edge_values(stores):
    """The test can fail: its catalogue holds the values that alias, and filters over
    them allow some items and not others."""
    values = [i["metadata"].get("n") for i in stores["items"]]
    assert {2**53, 2**53 + 1, float(2**53)} <= set(values)
    held = [i["metadata"].get("v") for i in stores["items"]]
    assert any(v is True for v in held) and any(type(v) is int and v == 1 for v in held)
    flt = {"must": [{"key": "n", "range": {"gt": 2**53}}]}
    assert 0 < len(reference(stores["items"], flt)) < N


# -- the findings, one sequence each -------------------------------------------------


def test_match_true_and_match_one_never_share_a_remembered_answer(stores):
    """`True == 1 == 1.0` with equal hashes: whichever was asked first answered both."""
    store = stores["sealed, remembered conditions"]
    items = stores["items"]
    asked = [
        {"must": [{"key": "v", "match": True}]},
        {"must": [{"key": "v", "match": 1}]},
        {"must": [{"key": "v", "match": 1.0}]},
        {"must_not": [{"key": "v", "match": True}]},
        {"must_not": [{"key": "v", "match": 1}]},
    ]
    answers = [answer(store, raw, NO_COLUMNS) for raw in asked]
    assert answers == [reference(items, raw) for raw in asked]
    assert answers[0] != answers[1]


@pytest.mark.parametrize("changes", [NO_CACHE + NO_COLUMNS, NO_CACHE])
def test_integers_beyond_2_53_are_compared_exactly_on_every_path(stores, changes):
    store = stores["sealed, columns"]
    items = stores["items"]
    for bound in ({"gt": 2**53}, {"gte": 2**53 + 1}, {"lt": 2**53 + 1}, {"lte": float(2**53)}):
        raw = {"must": [{"key": "n", "range": bound}]}
        assert answer(store, raw, changes) == reference(items, raw), bound
    raw = {"must": [{"key": "p", "range": {"gte": 2**53 + 1}}]}  # a bound a column rounds
    assert answer(store, raw, changes) == reference(items, raw)
    assert answer(store, {"must": [{"key": "n", "match": 2**53 + 1}]}, changes) == reference(
        items, {"must": [{"key": "n", "match": 2**53 + 1}]}
    )


def test_a_column_refuses_a_path_holding_integers_beyond_2_53(stores):
    """Read as float64, 2**53 + 1 would become 2**53: such a path keeps the field index."""
    files = sorted(Path(stores["sealed, columns"].directory).glob("seg.*.columns"))
    assert files
    for path in files:
        columns = read_columns(path)
        assert "n" not in columns.numbers
        assert "p" in columns.numbers and columns.numbers["p"].ids.size > 0
