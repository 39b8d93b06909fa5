"""The metadata filter language: what a search may be narrowed by.

A filter has the shape of Qdrant's payload filters, the one catalogue users know::

    {"must":     [condition, ...],   every condition holds
     "should":   [condition, ...],   at least one holds (when the list is not empty)
     "must_not": [condition, ...]}   none holds

A condition is one of::

    {"key": "colour", "match": "red"}                   equal (string, integer,
    {"key": "colour", "match": {"value": "red"}}         number or boolean)
    {"key": "colour", "match": {"any": ["red", "blue"]}} equal to one of them
    {"key": "price", "range": {"gte": 10, "lt": 20}}     a number within bounds
    {"must": [...], ...}                                 a nested filter

`key` is a dot path into the item's JSON metadata (`shop.city` reads
`{"shop": {"city": ...}}`); the key `label` is the item's label, and a metadata field
that is itself called "label" is reached as `metadata.label` (any key may carry that
prefix). A field holding a list of scalars matches when any element does; a missing
field matches nothing (so `must_not` keeps items without it). Booleans equal only
booleans (`true` is not 1). Numbers compare exactly as the numbers they are: an
integer is never rounded to a float (2**53 + 1 is above 2**53, and equals no float),
and an integer equals a float of the same value (1 equals 1.0). Integers fit the
64-bit range (`INT64_MIN`..`INT64_MAX`): the store refuses others in metadata and in
filters, and one found in an older index's metadata is not a value filters see.
Object keys containing a dot are not addressable.

`parse_filter` checks a filter and returns it as a `Filter`; `Filter.matches` is the
reference evaluation on one item (the store evaluates filters from its indexes,
_filter_plans.py, and is tested against this).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

from .errors import StoreError

LABEL_KEY = "label"
METADATA_PREFIX = "metadata."
CLAUSES = ("must", "should", "must_not")
RANGE_BOUNDS = ("gt", "gte", "lt", "lte")
MAX_FILTER_CONDITIONS = 256  # leaf conditions in one filter, nested ones included
MAX_FILTER_DEPTH = 8
MAX_ANY_VALUES = 1024
MAX_KEY_LENGTH = 256

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The integers the store keeps (SQLite's and numpy's int64): others are refused."""

Scalar = str | int | float | bool
Number = int | float


class FilterError(StoreError):
    """A filter that does not follow the language; the message names the problem."""


@dataclass(frozen=True)
class FieldRef:
    """What a condition's key reads: the item's label, or a metadata path."""

    label: bool
    path: tuple[str, ...]  # metadata path; () for the label

    @property
    def name(self) -> str:
        """The metadata path as dotted text (the form the field index stores)."""
        return ".".join(self.path)


def typed(value: Scalar | None) -> tuple[str, Scalar | None]:
    """`value` with its type's name: Python has `True == 1 == 1.0` with equal hashes,
    so conditions compared or hashed by their plain values would alias (a remembered
    answer to `match: true` served for `match: 1`)."""
    return (type(value).__name__, value)


class _TypedKey:
    """Equality and hashing by `key()`, whose values carry their types."""

    def key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.key() == self.key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.key())


@dataclass(frozen=True, eq=False)
class Match(_TypedKey):
    """The field equals one of `values` (one value for a plain match)."""

    field: FieldRef
    values: tuple[Scalar, ...]

    def holds(self, found: list[Scalar]) -> bool:
        return any(_same(v, w) for v in found for w in self.values)

    def key(self) -> tuple:
        return (self.field, tuple(typed(v) for v in self.values))


@dataclass(frozen=True, eq=False)
class Range(_TypedKey):
    """The field is a number (not a boolean) within the bounds given (None: open).

    Bounds keep their type: an integer bound is compared as an integer (Python and
    SQLite compare an integer with a float exactly)."""

    field: FieldRef
    gt: Number | None = None
    gte: Number | None = None
    lt: Number | None = None
    lte: Number | None = None

    def holds(self, found: list[Scalar]) -> bool:
        return any(_is_number(v) and self.admits(v) for v in found)

    def admits(self, x: Number) -> bool:
        return (
            (self.gt is None or x > self.gt)
            and (self.gte is None or x >= self.gte)
            and (self.lt is None or x < self.lt)
            and (self.lte is None or x <= self.lte)
        )

    def bounds(self) -> tuple[Number | None, ...]:
        return (self.gt, self.gte, self.lt, self.lte)

    def key(self) -> tuple:
        return (self.field, tuple(typed(b) for b in self.bounds()))


Condition = Union[Match, Range, "Filter"]


@dataclass(frozen=True)
class Filter:
    """A parsed filter: must (all), should (at least one, when any), must_not (none)."""

    must: tuple[Condition, ...] = ()
    should: tuple[Condition, ...] = ()
    must_not: tuple[Condition, ...] = ()

    def matches(self, label: str | None, metadata: Mapping[str, Any]) -> bool:
        """Whether an item with this label and metadata passes (the reference rule)."""
        return (
            all(_holds(c, label, metadata) for c in self.must)
            and (not self.should or any(_holds(c, label, metadata) for c in self.should))
            and not any(_holds(c, label, metadata) for c in self.must_not)
        )

    def leaves(self) -> Iterator[Match | Range]:
        """Every Match and Range condition, nested ones included."""
        for condition in (*self.must, *self.should, *self.must_not):
            if isinstance(condition, Filter):
                yield from condition.leaves()
            else:
                yield condition

    @property
    def empty(self) -> bool:
        return not (self.must or self.should or self.must_not)


FilterInput = Filter | Mapping[str, Any] | None
"""A filter as the index's methods take it: parsed, decoded JSON (parsed there), or none."""


def field_values(field: FieldRef, label: str | None, metadata: Mapping[str, Any]) -> list[Scalar]:
    """The scalars `field` holds for one item: [] when missing or not a scalar (list)."""
    if field.label:
        return [] if label is None else [label]
    node: Any = metadata
    for part in field.path:
        if not isinstance(node, Mapping) or part not in node:
            return []
        node = node[part]
    if isinstance(node, list):
        return [v for v in node if is_scalar(v)]
    return [node] if is_scalar(node) else []


def _holds(condition: Condition, label: str | None, metadata: Mapping[str, Any]) -> bool:
    if isinstance(condition, Filter):
        return condition.matches(label, metadata)
    return condition.holds(field_values(condition.field, label, metadata))


def is_scalar(value: Any) -> bool:
    """Whether filters see `value`: a string, a boolean, an int64 integer or a finite
    float (the values the field index stores)."""
    if isinstance(value, bool | str):
        return True
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    return isinstance(value, float) and math.isfinite(value)


def outside_int64(value: Any) -> bool:
    """An integer (not a boolean) that int64 cannot hold."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not INT64_MIN <= value <= INT64_MAX
    )


def find_outside_int64(value: Any, where: str) -> str | None:
    """The dotted place (from `where`) of the first integer in decoded JSON `value`
    that int64 cannot hold, or None."""
    if outside_int64(value):
        return where
    if isinstance(value, Mapping):
        for name, item in value.items():
            found = find_outside_int64(item, f"{where}.{name}")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = find_outside_int64(item, f"{where}[{i}]")
            if found:
                return found
    return None


def int64_message(where: str) -> str:
    """The one wording of the refusal (metadata, filters, bounds)."""
    return (
        f"{where}: integers must lie within the 64-bit range ({INT64_MIN} to "
        f"{INT64_MAX}); send a larger number as a string or a float"
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same(a: Scalar, b: Scalar) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    return a == b


# -- parsing --------------------------------------------------------------------------


def parse_filter(raw: Any) -> Filter:
    """Check `raw` (a filter as decoded JSON, or a Filter) against the language.

    Raises FilterError naming the problem and where it is (`must[1].range`).
    """
    if isinstance(raw, Filter):
        return raw
    counter = [0]
    return _parse_filter(raw, "filter", 1, counter)


def _parse_filter(raw: Any, where: str, depth: int, counter: list[int]) -> Filter:
    if depth > MAX_FILTER_DEPTH:
        raise FilterError(f"{where}: filters nest deeper than {MAX_FILTER_DEPTH} levels")
    if not isinstance(raw, Mapping):
        raise FilterError(f"{where} must be an object with must / should / must_not lists")
    unknown = sorted(set(raw) - set(CLAUSES))
    if unknown:
        raise FilterError(
            f"{where}: unknown field {unknown[0]!r} (a filter has {', '.join(CLAUSES)})"
        )
    clauses: dict[str, tuple[Condition, ...]] = {}
    for clause in CLAUSES:
        items = raw.get(clause, [])
        if isinstance(items, Mapping):  # one condition without the list
            items = [items]
        if not isinstance(items, list):
            raise FilterError(f"{where}.{clause} must be a list of conditions")
        clauses[clause] = tuple(
            _parse_condition(item, f"{where}.{clause}[{i}]", depth, counter)
            for i, item in enumerate(items)
        )
    return Filter(**clauses)


def _parse_condition(raw: Any, where: str, depth: int, counter: list[int]) -> Condition:
    if not isinstance(raw, Mapping):
        raise FilterError(f"{where} must be an object (a condition or a nested filter)")
    if "key" not in raw and set(raw) & set(CLAUSES):
        return _parse_filter(raw, where, depth + 1, counter)
    counter[0] += 1
    if counter[0] > MAX_FILTER_CONDITIONS:
        raise FilterError(f"a filter holds at most {MAX_FILTER_CONDITIONS} conditions")
    kinds = [name for name in ("match", "range") if name in raw]
    unknown = sorted(set(raw) - {"key", "match", "range"})
    if unknown:
        raise FilterError(
            f"{where}: unknown field {unknown[0]!r} (a condition has key and match or range)"
        )
    if "key" not in raw:
        raise FilterError(f"{where}: a condition needs a 'key'")
    if len(kinds) != 1:
        raise FilterError(f"{where}: give exactly one of 'match' and 'range'")
    field = _parse_key(raw["key"], f"{where}.key")
    if kinds[0] == "match":
        return Match(field, _parse_match(raw["match"], f"{where}.match"))
    return _parse_range(field, raw["range"], f"{where}.range")


def field_ref(key: Any, where: str = "key") -> FieldRef:
    """A field named as a filter condition names it: "label", or a metadata dot path
    (optionally "metadata."-prefixed); FilterError naming `where` otherwise."""
    return _parse_key(key, where)


def _parse_key(raw: Any, where: str) -> FieldRef:
    if not isinstance(raw, str) or not raw:
        raise FilterError(f"{where} must be a non-empty string")
    if len(raw) > MAX_KEY_LENGTH:
        raise FilterError(f"{where} is longer than {MAX_KEY_LENGTH} characters")
    if raw == LABEL_KEY:
        return FieldRef(label=True, path=())
    text = raw[len(METADATA_PREFIX) :] if raw.startswith(METADATA_PREFIX) else raw
    path = tuple(text.split("."))
    if not text or any(not part for part in path):
        raise FilterError(f"{where}: {raw!r} is not a dot path (an empty part)")
    return FieldRef(label=False, path=path)


def _parse_scalar(raw: Any, where: str) -> Scalar:
    if isinstance(raw, float) and not math.isfinite(raw):
        raise FilterError(f"{where} must be a finite number")
    if outside_int64(raw):
        raise FilterError(int64_message(where))
    if not is_scalar(raw):
        raise FilterError(f"{where} must be a string, a number or a boolean")
    return raw


def _parse_match(raw: Any, where: str) -> tuple[Scalar, ...]:
    if not isinstance(raw, Mapping):
        return (_parse_scalar(raw, where),)
    if set(raw) == {"value"}:
        return (_parse_scalar(raw["value"], f"{where}.value"),)
    if set(raw) == {"any"}:
        values = raw["any"]
        if not isinstance(values, list) or not values:
            raise FilterError(f"{where}.any must be a non-empty list")
        if len(values) > MAX_ANY_VALUES:
            raise FilterError(f"{where}.any holds more than {MAX_ANY_VALUES} values")
        return tuple(_parse_scalar(v, f"{where}.any[{i}]") for i, v in enumerate(values))
    raise FilterError(f'{where} must be a value, {{"value": v}} or {{"any": [...]}}')


def _parse_range(field: FieldRef, raw: Any, where: str) -> Range:
    if not isinstance(raw, Mapping) or not raw:
        raise FilterError(f"{where} must be an object with some of {', '.join(RANGE_BOUNDS)}")
    unknown = sorted(set(raw) - set(RANGE_BOUNDS))
    if unknown:
        raise FilterError(
            f"{where}: unknown bound {unknown[0]!r} (bounds: {', '.join(RANGE_BOUNDS)})"
        )
    bounds: dict[str, Number] = {}
    for name, value in raw.items():
        if outside_int64(value):
            raise FilterError(int64_message(f"{where}.{name}"))
        if not _is_number(value) or not math.isfinite(value):
            raise FilterError(f"{where}.{name} must be a finite number")
        bounds[name] = value
    return Range(field, **bounds)
