"""The metadata filter language, as callers outside the store import it.

Defined in index/store/filters.py (the store evaluates filters from its segments'
field indexes); its docstring is the language's reference.
"""

from .store.filters import (
    CLAUSES,
    LABEL_KEY,
    MAX_ANY_VALUES,
    MAX_FILTER_CONDITIONS,
    MAX_FILTER_DEPTH,
    Filter,
    FilterError,
    Match,
    Range,
    parse_filter,
)

__all__ = [
    "CLAUSES",
    "LABEL_KEY",
    "MAX_ANY_VALUES",
    "MAX_FILTER_CONDITIONS",
    "MAX_FILTER_DEPTH",
    "Filter",
    "FilterError",
    "Match",
    "Range",
    "parse_filter",
]
