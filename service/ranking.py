"""The answer of a request answered by a ranking (a search, a recommendation): its page
of hits, or with `group_by` its groups (index/grouping.py), timed as the search stage.

A route hands over `ranked(k, shaping)`, its ranking's first page of k under the
request's shaping (`Query`'s fields: re-scoring, offset, threshold); grouping reads it
deeper with no offset and counts the offset in groups.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from vitrieval.index.fusion import FusionError
from vitrieval.index.grouping import describe_grouping, grouped
from vitrieval.index.store import Hit, StoreError

from .answers import GroupOut, HitOut
from .errors import ApiError, store_error
from .schemas import RankedRequest
from .state import ServiceState, Timings

Ranked = Callable[[int, dict[str, Any]], Awaitable[list[tuple[int, Hit]]]]


async def ranked_answer(
    state: ServiceState, request: RankedRequest, ranked: Ranked, timings: Timings
) -> tuple[list[HitOut], list[GroupOut] | None]:
    """(hits, None), or with `group_by` ([], groups); refusals are 422s."""
    started = time.perf_counter()
    shaping = request.shaping()
    try:
        grouping = describe_grouping(request.group_by, request.group_size)
        if grouping is None:
            found = await ranked(request.k, shaping)
        else:
            whole = {**shaping, "offset": 0}
            groups = await grouped(lambda depth: ranked(depth, whole), request.k, grouping,
                                   request.offset)  # fmt: skip
    except FusionError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None
    except StoreError as exc:  # no DBA vectors, a filter on what the index lacks...
        raise store_error(exc, 422, "invalid_request") from None
    timings.search = (time.perf_counter() - started) * 1000
    state.metrics.observe_stage("search", timings.search / 1000)
    if grouping is not None:
        return [], [GroupOut(value=g.value, hits=hits_out(g.hits)) for g in groups]
    return hits_out(found), None


def check_depth(state: ServiceState, value: int, name: str = "k") -> None:
    """A 422 when a request asks for more hits than the server's `max_k` setting."""
    if value > state.settings.max_k:
        raise ApiError(422, "invalid_request", f"{name} must be <= {state.settings.max_k}")


def hits_out(found: list[tuple[int, Hit]]) -> list[HitOut]:
    return [
        HitOut(key=h.key, score=float(h.score), label=h.label, metadata=h.metadata)
        for _, h in found
    ]
