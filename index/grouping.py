"""Search results grouped by a field: the best `size` hits of each of the best groups.

A catalogue holds many near-identical items per product, album or shop; a search
grouped by that field answers k groups (the groups ordered by their best hit), each
with its `size` best hits, instead of k hits from one product. The field is named as a
filter condition names it (index/store/filters.py): "label", or a metadata dot path;
an item whose field is missing (or not a scalar) is in no group, and one whose field
is a list is in the group of each of its scalars.

Exact over a ranking: in the ranking's order, the groups appear in the order of their
best hits, and each group's hits in its own order. So once a ranking's prefix holds k
+ offset groups, each with `size` hits (or the ranking has ended), those are the
answer; until then the ranking is read twice as deep, up to MAX_DEPTH hits (past it
the last groups may hold fewer than `size` hits, and there may be fewer groups).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .store import Hit
from .store.errors import StoreError
from .store.filters import FieldRef, Scalar, field_ref, field_values, typed
from .store.request import MAX_DEPTH, checked_offset

MAX_GROUP_SIZE = 100
"""The most hits one group may ask for."""
DEFAULT_GROUP_SIZE = 3

Ranking = list[tuple[int, Hit]]
"""One query's hits best first, each with its item id."""


@dataclass(frozen=True)
class Grouping:
    """Group by `by` (a field: "label" or a metadata path), `size` hits per group."""

    by: str
    size: int = DEFAULT_GROUP_SIZE
    field: FieldRef = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "field", field_ref(self.by, "group_by"))
        size = self.size
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_GROUP_SIZE:
            raise StoreError(
                f"group_size must be an integer from 1 to {MAX_GROUP_SIZE}, got {size!r}"
            )

    def values(self, hit: Hit) -> list[Scalar]:
        """The group values of one hit (none, one, or a list's several)."""
        return field_values(self.field, hit.label, hit.metadata)


@dataclass
class Group:
    """One group: its field `value` and its best hits (with their item ids)."""

    value: Scalar
    hits: Ranking


def group(ranking: Ranking, grouping: Grouping, groups: int) -> tuple[list[Group], bool]:
    """The first `groups` groups of `ranking` with up to `grouping.size` hits each, and
    whether they are settled: that many groups were seen and each is full."""
    found: dict[Hashable, Group] = {}
    for pair in ranking:
        for value in grouping.values(pair[1]):
            key = typed(value)  # 1, 1.0 and True are three groups
            entry = found.get(key)
            if entry is None:
                if len(found) == groups:
                    continue  # a later group's best hit: past the page
                entry = found[key] = Group(value, [])
            if len(entry.hits) < grouping.size:
                entry.hits.append(pair)
    chosen = list(found.values())
    full = len(chosen) == groups and all(len(g.hits) == grouping.size for g in chosen)
    return chosen, full


async def grouped(
    rank: Callable[[int], Awaitable[Ranking]],
    k: int,
    grouping: Grouping,
    offset: int = 0,
) -> list[Group]:
    """Groups offset + 1 to offset + k of the ranking `rank(depth)` answers (its top
    `depth` hits), read deeper until settled (module docstring)."""
    offset = checked_offset(k, offset)
    wanted = k + offset
    depth = min(MAX_DEPTH, wanted * grouping.size * 2)
    while True:
        ranking = await rank(depth)
        chosen, full = group(ranking, grouping, wanted)
        if full or len(ranking) < depth or depth == MAX_DEPTH:
            return chosen[offset:]
        depth = min(MAX_DEPTH, depth * 4)


def describe_grouping(group_by: Any, group_size: Any) -> Grouping | None:
    """The `Grouping` of a request's `group_by` and `group_size` (None without
    `group_by`; a StoreError naming what is wrong)."""
    if group_by is None:
        if group_size is not None:
            raise StoreError("group_size needs group_by")
        return None
    return Grouping(group_by, DEFAULT_GROUP_SIZE if group_size is None else group_size)
