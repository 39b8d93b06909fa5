"""/v1/items: add, read, delete items (mutations need the API key) and thumbnails.

An add or delete answers only after the store has journalled it durably
(index/store/_journal.py): a 201 or 200 means the change survives a crash.

Keys may contain slashes (`digits/00017`, a folder-relative path): the routes take
the rest of the path as the key, so a key cannot end in `/thumbnail`, nor have an
empty, `.` or `..` segment, which HTTP clients rewrite before sending the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from fastapi import Path as PathParam
from PIL import Image
from pydantic import AfterValidator

from vitrieval.index.query import Where, search
from vitrieval.index.runtime.images import open_image
from vitrieval.index.store import KeyExistsError, StoreError

from ..answers import ItemDeleted, ItemOut, ItemWritten
from ..deps import ReadAccess, ServiceDep, WriteAccess
from ..duplicates import chosen_threshold
from ..errors import ApiError, binary_responses, error_responses, storage_error, store_error
from ..inputs import RequestBody
from ..schemas import ItemCreate
from ..state import ServiceState, Timings
from ..text import checked_lookup_key

router = APIRouter(prefix="/v1/items", tags=["items"])

ITEM_BODY = RequestBody(ItemCreate, form_needs_image=True)
"""An item's vector is JSON only: a form adds an image."""
MIN_THUMBNAIL_SIZE = 16
MAX_THUMBNAIL_SIZE = 512
KeyPath = Annotated[
    str,
    PathParam(description="the item's key (slashes allowed)"),
    AfterValidator(checked_lookup_key),
]


@router.post(
    "",
    operation_id="add_item",
    status_code=201,
    response_model=ItemWritten,
    summary="Add an item (image or vector) under a key",
    dependencies=[WriteAccess],
    openapi_extra=ITEM_BODY.openapi(),
    responses=error_responses(400, 401, 403, 409, 413, 415, 422, 503),
)
async def add_item(request: Request, state: ServiceDep) -> ItemWritten:
    item, image = await ITEM_BODY.read_one(request)
    if (image is None) == (item.vector is None):
        raise ApiError(422, "invalid_request", "give exactly one of: an image, or a vector")
    if image is not None:
        vector = await state.embed_upload(image, Timings())
        try:
            path, created = await asyncio.to_thread(state.save_upload, image.data)
        except OSError as exc:  # ENOSPC, EDQUOT, EIO...: as the journal failing, a 503
            raise storage_error(exc) from None
    else:
        vector, path, created = state.check_vector(item.vector), None, False
    metadata = item.metadata or {}
    try:
        if item.on_duplicate == "reject":
            await _refuse_duplicate(state, item, vector)
        replaced = item.replace and await state.index.contains(item.key)
        await state.index.add(
            [item.key],
            vector[None, :],
            labels=[item.label],
            paths=[str(path) if path else None],
            metadata=[metadata],
            replace=item.replace,
        )
    except (StoreError, OSError, ApiError) as exc:
        if created:  # nobody refers to the upload: do not leave it behind
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise exc if isinstance(exc, ApiError) else _store_error(exc, item.key) from None
    return ItemWritten(
        key=item.key,
        label=item.label,
        metadata=metadata,
        has_image=path is not None,
        replaced=replaced,
    )


async def _refuse_duplicate(state: ServiceState, item: ItemCreate, vector: np.ndarray) -> None:
    """A 409 `duplicate` when an indexed item (not the one a replace overwrites) scores
    at least the item's duplicate_threshold (else the index's calibrated one) against
    `vector`. Two such adds at once
    may both pass: the check is a search, not a lock."""
    threshold = await chosen_threshold(state.index, item.duplicate_threshold, None)
    source = "calibrated threshold" if item.duplicate_threshold is None else "duplicate_threshold"
    where = Where(exclude_keys=[item.key] if item.replace else [])
    found = await search(state.index, vector[None, :], 1, where=where, score_threshold=threshold)
    if found[0]:
        hit = found[0][0][1]
        raise ApiError(
            409,
            "duplicate",
            f"{hit.key!r} is a near-duplicate (score {hit.score:.4f}, at least the "
            f"{source} {threshold:g}); nothing was added",
        )


@router.get(
    "/{key:path}/thumbnail",
    operation_id="get_thumbnail",
    summary="A JPEG thumbnail of the item's image",
    dependencies=[ReadAccess],
    response_class=Response,
    responses=binary_responses("image/jpeg", "the thumbnail, a JPEG", 401, 404),
)
async def thumbnail(
    key: KeyPath,
    state: ServiceDep,
    size: Annotated[
        int,
        Query(ge=MIN_THUMBNAIL_SIZE, le=MAX_THUMBNAIL_SIZE, description="longest side, pixels"),
    ] = 160,
) -> Response:
    record = await state.index.get(key)
    if record is None:
        raise ApiError(404, "unknown_key", f"no item with key {key!r}")
    if record.path is None:
        raise ApiError(404, "no_image", f"item {key!r} was added without an image")
    data = await asyncio.to_thread(
        thumbnail_jpeg, Path(record.path), size, state.settings.max_pixels
    )
    if data is None:
        raise ApiError(404, "no_image", f"the image of item {key!r} is not readable here")
    return Response(data, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})


@router.get(
    "/{key:path}",
    operation_id="get_item",
    response_model=ItemOut,
    response_model_exclude_none=False,
    summary="One item's label, metadata and (optionally) vector",
    dependencies=[ReadAccess],
    responses=error_responses(401, 404),
)
async def get_item(
    key: KeyPath,
    state: ServiceDep,
    vector: Annotated[bool, Query(description="include the stored vector")] = False,
) -> ItemOut:
    record = await state.index.get(key)
    if record is None:
        raise ApiError(404, "unknown_key", f"no item with key {key!r}")
    return ItemOut(
        key=record.key,
        label=record.label,
        metadata=record.metadata,
        has_image=record.path is not None,
        vector=record.vector.astype(float).tolist() if vector else None,
    )


@router.delete(
    "/{key:path}",
    operation_id="delete_item",
    response_model=ItemDeleted,
    summary="Delete an item",
    dependencies=[WriteAccess],
    responses=error_responses(401, 403, 404, 503),
)
async def delete_item(key: KeyPath, state: ServiceDep) -> ItemDeleted:
    try:
        removed = await state.index.remove([key])
    except (StoreError, OSError) as exc:
        raise _store_error(exc, key) from None
    if not removed:
        raise ApiError(404, "unknown_key", f"no item with key {key!r}")
    return ItemDeleted(key=key, deleted=True)


def _store_error(exc: StoreError | OSError, key: str) -> ApiError:
    if isinstance(exc, OSError):
        return storage_error(exc)
    if isinstance(exc, KeyExistsError):
        return ApiError(
            409, "key_exists", f"an item with key {key!r} exists; send replace=true to overwrite it"
        )
    return store_error(exc, 409, "index_refused")  # e.g. an IVF index not trained yet


def thumbnail_jpeg(path: Path, size: int, max_pixels: int) -> bytes | None:
    """The item's image (a path recorded at indexing time, relative to the working
    folder or absolute) as a JPEG no larger than size x size; None if unreadable."""
    try:
        image = open_image(path, max_pixels, draft_size=size)
    except Exception:
        return None
    image.thumbnail((size, size), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()
