"""The metadata filter language, as callers outside the store import it.

Defined in index/store/filters.py (the store evaluates filters from its segments'
field indexes); its docstring is the language's reference.
"""

from .store.filters import (
    CLAUSES,
    INT64_MAX,
    INT64_MIN,
    LABEL_KEY,
    MAX_ANY_VALUES,
    MAX_FILTER_CONDITIONS,
    MAX_FILTER_DEPTH,
    Filter,
    FilterError,
    Match,
    Range,
    find_outside_int64,
    int64_message,
    parse_filter,
)

__all__ = [
    "CLAUSES",
    "INT64_MAX",
    "INT64_MIN",
    "LABEL_KEY",
    "MAX_ANY_VALUES",
    "MAX_FILTER_CONDITIONS",
    "MAX_FILTER_DEPTH",
    "Filter",
    "FilterError",
    "Match",
    "Range",
    "find_outside_int64",
    "int64_message",
    "parse_filter",
]
