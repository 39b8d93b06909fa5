"""/v1/collections/{collection}/snapshots: point-in-time copies of a collection, taken
while writes go on (index/collection_snapshots.py; docs/collections.md, "Backups").

- POST takes one (a key that may write the collection) and answers 201 with its id;
- GET lists them; GET .../{snapshot} streams one as a tar file, which
  `vitrieval-index restore FILE --out DIR` makes an index folder of, and which
  PUT /v1/collections/{name} `{"snapshot": ID}` makes a collection of;
- DELETE .../{snapshot} deletes one.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from vitrieval.index.collection_snapshots import delete_snapshot, list_snapshots, take_snapshot
from vitrieval.index.collections import SNAPSHOT_ID

from ..answers import SnapshotDeleted, SnapshotList, SnapshotOut
from ..catalogue import on_folder
from ..deps import CatalogueDep, ReadAccess, WriteAccess, collection_of
from ..errors import binary_responses, error_responses
from .collections import COLLECTION_PREFIX, CollectionPath

router = APIRouter(prefix=f"{COLLECTION_PREFIX}/snapshots", tags=["snapshots"])
TAR = "application/octet-stream"
"""A tar file, as the generic binary type that client generators read (its name, in
Content-Disposition, ends in .tar)."""
SnapshotPath = Annotated[
    str, PathParam(pattern=f"^{SNAPSHOT_ID.pattern}$", description="a snapshot id")
]


@router.post(
    "",
    operation_id="create_snapshot",
    status_code=201,
    summary="Take a snapshot of a collection while writes go on",
    dependencies=[WriteAccess],
    responses=error_responses(400, 401, 403, 404, 422, 503),
)
async def create_snapshot(
    collection: CollectionPath, request: Request, catalogue: CatalogueDep
) -> SnapshotOut:
    taken = await on_folder(take_snapshot, catalogue.folder, collection_of(request))
    return SnapshotOut.model_validate(taken.to_json())


@router.get(
    "",
    operation_id="list_snapshots",
    summary="A collection's snapshots, oldest first",
    dependencies=[ReadAccess],
    responses=error_responses(400, 401, 403, 404),
)
async def get_snapshots(
    collection: CollectionPath, request: Request, catalogue: CatalogueDep
) -> SnapshotList:
    found = await on_folder(list_snapshots, catalogue.folder, collection_of(request))
    return SnapshotList(snapshots=[SnapshotOut.model_validate(s.to_json()) for s in found])


@router.get(
    "/{snapshot}",
    operation_id="download_snapshot",
    summary="Download a snapshot as a tar file",
    dependencies=[ReadAccess],
    response_class=FileResponse,
    responses=binary_responses(TAR, "the snapshot, a tar file", 400, 401, 403, 404),
)
async def download_snapshot(
    collection: CollectionPath, snapshot: SnapshotPath, request: Request, catalogue: CatalogueDep
) -> FileResponse:
    name = collection_of(request)
    path = await on_folder(catalogue.folder.snapshot_file, snapshot, name)
    return FileResponse(path, media_type=TAR, filename=f"{name}-{snapshot}.tar")


@router.delete(
    "/{snapshot}",
    operation_id="delete_snapshot",
    summary="Delete a snapshot",
    dependencies=[WriteAccess],
    responses=error_responses(400, 401, 403, 404),
)
async def remove_snapshot(
    collection: CollectionPath, snapshot: SnapshotPath, request: Request, catalogue: CatalogueDep
) -> SnapshotDeleted:
    await on_folder(delete_snapshot, catalogue.folder, collection_of(request), snapshot)
    return SnapshotDeleted(snapshot=snapshot, deleted=True)
