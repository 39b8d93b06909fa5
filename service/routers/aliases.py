"""/v1/aliases: names that point at collections, switched atomically (admin key), and
the model switch gated by evaluation (docs/collections.md, "Switching a model").

An alias works wherever a collection name does. A switch is durable when answered
(aliases.json replaced atomically: index/collections.py) and takes effect for the
requests that start after it; those in flight finish on the collection they started
on (service/catalogue.py).

POST /v1/aliases/{alias}/promote evaluates the collection the alias names and the
candidate with the same evaluation request (as POST /v1/evaluate answers it) and
points the alias at the candidate only when

    candidate[metric] >= current[metric] + min_gain

(index/promotion.py `wins`). The switch is a compare-and-set: an alias switched by
someone else meanwhile is left alone (409). The decision is logged.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from vitrieval.index.promotion import wins
from vitrieval.index.store import StoreError

from ..answers import AliasList, AliasOut, PromoteResponse
from ..catalogue import Catalogue, on_folder
from ..deps import AdminAccess, CatalogueDep, ReaderDep, path_name
from ..errors import ApiError, error_responses
from ..inputs import RequestBody
from ..operations import operation
from ..schemas import AliasSet, EvaluateRequest, PromoteRequest
from .evaluate import evaluate_state

logger = logging.getLogger("vitrieval.service")
router = APIRouter(prefix="/v1/aliases", tags=["aliases"])
ALIAS_BODY = RequestBody(AliasSet, image_field=None)
PROMOTE_BODY = RequestBody(PromoteRequest, image_field=None)
AliasPath = path_name("an alias name")


@operation(router, "GET", "", error_responses(400, 401))
async def list_aliases(catalogue: CatalogueDep, who: ReaderDep) -> AliasList:
    """The aliases and the collections they name (those the API key may read)."""
    readable = {a: c for a, c in catalogue.aliases().items() if who.may_read([a, c])}
    return AliasList(aliases=readable)


@ALIAS_BODY.post(
    router,
    "/{alias}",
    error_responses(400, 401, 403, 404, 409, 413, 415, 422),
    method="PUT",
    dependencies=[AdminAccess],
)
async def set_alias(alias: AliasPath, request: Request, catalogue: CatalogueDep) -> AliasOut:
    """Point an alias at a collection, atomically (the admin key)."""
    body, _ = await ALIAS_BODY.read(request)
    previous = await on_folder(catalogue.folder.set_alias, alias, body.collection)
    return AliasOut(alias=alias, collection=body.collection, previous=previous)


@operation(
    router, "DELETE", "/{alias}", error_responses(400, 401, 403, 404), dependencies=[AdminAccess]
)
async def delete_alias(alias: AliasPath, catalogue: CatalogueDep) -> AliasOut:
    """Delete an alias (the admin key)."""
    target = await on_folder(catalogue.folder.delete_alias, alias)
    return AliasOut(alias=alias, collection=target)


@PROMOTE_BODY.post(
    router,
    "/{alias}/promote",
    error_responses(400, 401, 403, 404, 409, 413, 415, 422, 429),
    dependencies=[AdminAccess],
)
async def promote(alias: AliasPath, request: Request, catalogue: CatalogueDep) -> PromoteResponse:
    """Switch an alias to a candidate collection only if it evaluates better."""
    body, _ = await PROMOTE_BODY.read(request)
    current = catalogue.aliases().get(alias)
    if current is None:
        raise ApiError(404, "not_found", f"no alias named {alias!r}")
    candidate = catalogue.resolve(body.collection)
    before = await _evaluate(catalogue, current, body.evaluation)
    after = await _evaluate(catalogue, candidate, body.evaluation)
    try:
        better = wins(before, after, body.metric, body.min_gain)
    except StoreError as exc:  # a metric the evaluation has not
        raise ApiError(422, "invalid_request", str(exc)) from None
    switched = candidate != current and better
    if switched:
        await on_folder(catalogue.folder.set_alias, alias, candidate, expected=current)
    logger.info(
        "promote %s: %s %s %r, %s %r, min_gain %g: %s",
        alias,
        body.metric,
        current,
        before.get(body.metric),
        candidate,
        after.get(body.metric),
        body.min_gain,
        f"switched to {candidate}" if switched else f"kept {current}",
    )
    return PromoteResponse.model_validate(
        {
            "alias": alias,
            "switched": switched,
            "metric": body.metric,
            "min_gain": body.min_gain,
            "current_collection": current,
            "candidate_collection": candidate,
            "current": before,
            "candidate": after,
        }
    )


async def _evaluate(catalogue: Catalogue, name: str, body: EvaluateRequest) -> dict[str, Any]:
    async with catalogue.using(name) as state:
        answer = await evaluate_state(state, body)
    return answer.model_dump()
