"""Both kinds of segment keep the declared `Segment` contract (segment_contract.py):
every member it names, each method with the same parameters."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from vitrieval.index.store import IndexStore
from vitrieval.index.store._memory_segment import MemorySegment
from vitrieval.index.store._sealed_segment import SealedSegment
from vitrieval.index.store.segment_contract import Segment

METHODS = sorted(
    name
    for name, member in vars(Segment).items()
    if not name.startswith("_") and inspect.isfunction(member)
)
PROPERTIES = sorted(name for name, member in vars(Segment).items() if isinstance(member, property))


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_contract_names_what_a_store_reads():
    assert {"live_ids", "describe", "searched", "live_rows", "close"} <= set(METHODS)
    assert PROPERTIES == ["ntotal", "tombstones"]


def test_segments_know_nothing_of_dba():
    """DBA is a derived index beside the segments (augment.py), not a segment's."""
    for name in METHODS:
        names = [p for p, _ in _parameters(getattr(Segment, name))]
        assert "augmented" not in names and "dba" not in name, name


@pytest.mark.parametrize("kind", [SealedSegment, MemorySegment])
@pytest.mark.parametrize("name", METHODS)
def test_each_kind_has_each_method_with_the_same_parameters(kind, name):
    method = getattr(kind, name, None)
    assert callable(method), f"{kind.__name__} has no {name}"
    assert _parameters(method) == _parameters(getattr(Segment, name))


def test_open_segments_of_both_kinds_are_segments(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    store = IndexStore.create(tmp_path / "i", dim=8, gpu="cpu")
    store.add([f"k{i}" for i in range(3)], x[:3])
    store.save()
    store.add([f"k{i}" for i in range(3, 6)], x[3:])
    segments = store._state.segments()
    assert {type(s) for s in segments} == {SealedSegment, MemorySegment}
    assert all(isinstance(s, Segment) for s in segments)
    # runtime_checkable checks members exist; their values are of the declared kinds
    assert all(isinstance(s.tombstones, set) and isinstance(s.ntotal, int) for s in segments)
    store.close()
