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

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from vitrieval.index import collection_snapshots as kept
from vitrieval.index.collections import SNAPSHOT_ID

from ..answers import SnapshotDeleted, SnapshotList, SnapshotOut
from ..catalogue import on_folder
from ..deps import AddressedDep, ReadAccess, WriteAccess
from ..errors import binary_responses, error_responses
from ..operations import operation
from .collections import COLLECTION_PREFIX

router = APIRouter(prefix=f"{COLLECTION_PREFIX}/snapshots", tags=["snapshots"])
TAR = "application/octet-stream"
"""A tar file, as the generic binary type that client generators read (its name, in
Content-Disposition, ends in .tar)."""
SnapshotPath = Annotated[
    str, PathParam(pattern=f"^{SNAPSHOT_ID.pattern}$", description="a snapshot id")
]
ERRORS = error_responses(400, 401, 403, 404)


@operation(router, "POST", "", ERRORS | error_responses(422, 503), 201, dependencies=[WriteAccess])
async def create_snapshot(target: AddressedDep) -> SnapshotOut:
    """Take a snapshot of a collection while writes go on."""
    taken = await on_folder(kept.take_snapshot, target.folder, target.collection)
    return SnapshotOut.model_validate(taken.to_json())


@operation(router, "GET", "", ERRORS, dependencies=[ReadAccess])
async def list_snapshots(target: AddressedDep) -> SnapshotList:
    """A collection's snapshots, oldest first."""
    found = await on_folder(kept.list_snapshots, target.folder, target.collection)
    return SnapshotList(snapshots=[SnapshotOut.model_validate(s.to_json()) for s in found])


@operation(
    router, "GET", "/{snapshot}", binary_responses(TAR, "the snapshot, a tar file", *ERRORS),
    dependencies=[ReadAccess], response_class=FileResponse,
)  # fmt: skip
async def download_snapshot(target: AddressedDep, snapshot: SnapshotPath) -> FileResponse:
    """Download a snapshot as a tar file."""
    path = await on_folder(target.folder.snapshot_file, snapshot, target.collection)
    return FileResponse(path, media_type=TAR, filename=f"{target.collection}-{snapshot}.tar")


@operation(router, "DELETE", "/{snapshot}", ERRORS, dependencies=[WriteAccess])
async def delete_snapshot(target: AddressedDep, snapshot: SnapshotPath) -> SnapshotDeleted:
    """Delete a snapshot."""
    await on_folder(kept.delete_snapshot, target.folder, target.collection, snapshot)
    return SnapshotDeleted(snapshot=snapshot, deleted=True)
