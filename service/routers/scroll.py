"""POST /v1/scroll: every item a filter allows, page by page in key order.

For exports and admin tools: a search ranks the items nearest a query, at most
`MAX_DEPTH` deep; a scroll lists a whole selection, each item once, `limit` at a time
(not bounded by `max_k`). The answer's `next` is the following call's `after`
(index/store/_scroll.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from vitrieval.index.store import StoreError
from vitrieval.index.store.request import Where

from ..answers import ListedItemOut, ScrollResponse
from ..deps import ReadAccess, ServiceDep
from ..errors import error_responses, store_error
from ..inputs import RequestBody
from ..schemas import ScrollRequest

router = APIRouter(prefix="/v1", tags=["items"], dependencies=[ReadAccess])
SCROLL_BODY = RequestBody(ScrollRequest, image_field=None)
"""JSON, or a form (its filter as JSON text): no image."""


@SCROLL_BODY.post(router, "/scroll", error_responses(400, 401, 413, 415, 422))
async def scroll(request: Request, state: ServiceDep) -> ScrollResponse:
    """List the items a filter allows, a page at a time, in key order."""
    body, _ = await SCROLL_BODY.read(request)
    flt = Where(label=body.label, filter=body.filter).allowed
    try:
        page = await state.index.scroll(flt, body.limit, body.after)
    except StoreError as exc:  # a filter on a field the index lacks...
        raise store_error(exc, 422, "invalid_request") from None
    items = [ListedItemOut(key=i.key, label=i.label, metadata=i.metadata) for i in page.items]
    return ScrollResponse(items=items, next=page.next)
