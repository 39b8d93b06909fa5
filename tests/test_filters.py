"""The filter language: parsing, its errors, and the reference rule on hand-made items."""

from __future__ import annotations

import pytest

from vitrieval.index.store import StoreError
from vitrieval.index.store.filters import (
    MAX_FILTER_CONDITIONS,
    MAX_FILTER_DEPTH,
    FilterError,
    parse_filter,
)

SHOE = {"colour": "red", "sizes": [38, 39], "price": 12.5, "shop": {"city": "Oslo"}}
BOOT = {"colour": "black", "price": 80, "in_stock": True, "label": "winter"}
SOCK = {"colour": ["red", "blue"], "in_stock": 1}


def passes(raw: dict) -> list[str]:
    """Which of the three hand-made items (labelled as named) pass `raw`."""
    flt = parse_filter(raw)
    items = {"shoe": ("footwear", SHOE), "boot": ("footwear", BOOT), "sock": (None, SOCK)}
    return [name for name, (label, metadata) in items.items() if flt.matches(label, metadata)]


def test_match_any_and_range_follow_the_hand_reading() -> None:
    assert passes({"must": [{"key": "colour", "match": "red"}]}) == ["shoe", "sock"]
    assert passes({"must": [{"key": "colour", "match": {"value": "black"}}]}) == ["boot"]
    assert passes({"must": [{"key": "colour", "match": {"any": ["blue", "black"]}}]}) == [
        "boot",
        "sock",
    ]
    assert passes({"must": [{"key": "price", "range": {"gte": 12.5, "lt": 80}}]}) == ["shoe"]
    assert passes({"must": [{"key": "price", "range": {"gt": 12.5}}]}) == ["boot"]
    assert passes({"must": [{"key": "sizes", "match": 39}]}) == ["shoe"]  # a list element
    assert passes({"must": [{"key": "sizes", "range": {"lte": 38}}]}) == ["shoe"]
    assert passes({"must": [{"key": "shop.city", "match": "Oslo"}]}) == ["shoe"]


def test_label_metadata_label_and_types() -> None:
    assert passes({"must": [{"key": "label", "match": "footwear"}]}) == ["shoe", "boot"]
    assert passes({"must": [{"key": "metadata.label", "match": "winter"}]}) == ["boot"]
    assert passes({"must": [{"key": "metadata.colour", "match": "red"}]}) == ["shoe", "sock"]
    # booleans equal only booleans: 1 is not true, true is not 1
    assert passes({"must": [{"key": "in_stock", "match": True}]}) == ["boot"]
    assert passes({"must": [{"key": "in_stock", "match": 1}]}) == ["sock"]
    assert passes({"must": [{"key": "in_stock", "range": {"gte": 1}}]}) == ["sock"]
    # a string never falls in a numeric range, a number never equals a string
    assert passes({"must": [{"key": "colour", "range": {"gte": 0}}]}) == []
    assert passes({"must": [{"key": "price", "match": "80"}]}) == []
    assert passes({"must": [{"key": "price", "match": 80.0}]}) == ["boot"]


def test_must_should_must_not_and_nesting() -> None:
    # a missing field matches nothing, so must_not keeps the items without it
    assert passes({"must_not": [{"key": "shop.city", "match": "Oslo"}]}) == ["boot", "sock"]
    assert passes(
        {"should": [{"key": "colour", "match": "black"}, {"key": "sizes", "match": 38}]}
    ) == ["shoe", "boot"]
    assert passes(
        {
            "must": [{"key": "colour", "match": {"any": ["red", "black"]}}],
            "must_not": [
                {
                    "must": [
                        {"key": "label", "match": "footwear"},
                        {"key": "price", "range": {"lt": 50}},
                    ]
                }
            ],
        }
    ) == ["boot", "sock"]
    assert passes({}) == ["shoe", "boot", "sock"]
    assert passes({"must": {"key": "colour", "match": "red"}}) == ["shoe", "sock"]  # one, no list


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ([], r"filter must be an object"),
        ({"mustnt": []}, r"filter: unknown field 'mustnt'"),
        ({"must": "colour"}, r"filter.must must be a list"),
        ({"must": [{"match": "red"}]}, r"filter.must\[0\]: a condition needs a 'key'"),
        ({"must": [{"key": "a"}]}, r"filter.must\[0\]: give exactly one of 'match' and 'range'"),
        (
            {"must": [{"key": "a", "match": 1, "range": {"gt": 0}}]},
            r"exactly one of 'match' and 'range'",
        ),
        ({"must": [{"key": "", "match": 1}]}, r"filter.must\[0\].key must be a non-empty"),
        ({"must": [{"key": "a..b", "match": 1}]}, r"not a dot path"),
        ({"must": [{"key": "a", "match": [1, 2]}]}, r"filter.must\[0\].match must be a string"),
        ({"must": [{"key": "a", "match": {"any": []}}]}, r"match.any must be a non-empty list"),
        ({"must": [{"key": "a", "match": {"any": [{}]}}]}, r"match.any\[0\] must be a string"),
        ({"must": [{"key": "a", "match": {"text": "x"}}]}, r"match must be a value"),
        ({"must": [{"key": "a", "range": {}}]}, r"range must be an object with some of"),
        ({"must": [{"key": "a", "range": {"ge": 1}}]}, r"unknown bound 'ge'"),
        ({"must": [{"key": "a", "range": {"gt": "1"}}]}, r"range.gt must be a finite number"),
        ({"must": [{"key": "a", "range": {"gt": True}}]}, r"range.gt must be a finite number"),
        ({"should": [{"key": "a", "match": 1, "extra": 2}]}, r"should\[0\]: unknown field 'extra'"),
    ],
)
def test_invalid_filters_name_the_problem(raw: object, problem: str) -> None:
    with pytest.raises(FilterError, match=problem):
        parse_filter(raw)


def test_size_limits_and_error_type() -> None:
    too_many = {"must": [{"key": "a", "match": i} for i in range(MAX_FILTER_CONDITIONS + 1)]}
    with pytest.raises(FilterError, match=f"at most {MAX_FILTER_CONDITIONS} conditions"):
        parse_filter(too_many)
    deep: dict = {"must": [{"key": "a", "match": 1}]}
    for _ in range(MAX_FILTER_DEPTH):
        deep = {"must": [deep]}
    with pytest.raises(FilterError, match=f"deeper than {MAX_FILTER_DEPTH}"):
        parse_filter(deep)
    assert issubclass(FilterError, StoreError)  # the CLI and the service report it as one
