"""/v1/collections: the collections of a data folder (docs/collections.md).

- GET /v1/collections lists the collections the caller's key may read;
- PUT /v1/collections/{name} creates one (admin key), from a model file under the
  data folder's models/ or from a snapshot; 409 when the name is taken;
- GET /v1/collections/{name} describes one (`name` may be an alias);
- DELETE /v1/collections/{name} deletes one (admin key; refused while an alias names it).

Every route of /v1/... that reads or changes an index (items, search, embed,
recommend, scroll, duplicates, evaluate, info) is also served under
/v1/collections/{collection}/... (`in_collection`), addressing that collection; the
plain /v1/... routes address the default one.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute

from ..answers import CollectionDeleted, CollectionList, CollectionOut
from ..deps import AdminAccess, CatalogueDep, CollectionPath, ReaderDep, forbidden, path_name
from ..errors import error_responses
from ..inputs import RequestBody
from ..operations import operation
from ..schemas import CollectionCreate

router = APIRouter(prefix="/v1/collections", tags=["collections"])
CREATE_BODY = RequestBody(CollectionCreate, image_field=None)
COLLECTION_PREFIX = "/v1/collections/{collection}"
IN_COLLECTION = "_in_collection"
"""The suffix of a collection route's operation id: `search` is also
`search_in_collection`."""


NamePath = path_name("a collection name")


async def collection_param(collection: CollectionPath) -> str:
    """The {collection} of a collection route, checked (a 422 for a name no collection
    can have) and documented."""
    return collection


def in_collection(router: APIRouter) -> APIRouter:
    """`router`'s /v1/... routes again under /v1/collections/{collection}/..., each with
    its operation id suffixed by IN_COLLECTION (the routes find their collection in the
    path: service/deps.py)."""
    scoped = APIRouter(dependencies=[Depends(collection_param)])
    for route in router.routes:
        if not isinstance(route, APIRoute) or not route.path.startswith("/v1/"):
            continue
        operation = route.operation_id or route.name
        scoped.add_api_route(
            COLLECTION_PREFIX + route.path.removeprefix("/v1"),
            route.endpoint,
            response_model=route.response_model,
            status_code=route.status_code,
            tags=route.tags,
            dependencies=route.dependencies,
            summary=route.summary and f"{route.summary} (in a collection)",
            description=route.description,
            # the collection may be unknown (404), closed to the key (403), damaged (503)
            responses=error_responses(403, 404, 422, 503) | route.responses,
            methods=route.methods,
            operation_id=operation + IN_COLLECTION,
            include_in_schema=route.include_in_schema,
            response_class=route.response_class,
            name=route.name + IN_COLLECTION,
            openapi_extra=route.openapi_extra,
        )
    return scoped


@operation(router, "GET", "", error_responses(400, 401))
async def list_collections(catalogue: CatalogueDep, who: ReaderDep) -> CollectionList:
    """The collections (those the API key may read)."""
    readable = [n for n in catalogue.folder.names() if who.may_read([n])]
    return CollectionList.model_validate({"collections": [catalogue.describe(n) for n in readable]})


@CREATE_BODY.post(
    router,
    "/{collection}",
    error_responses(400, 401, 403, 404, 409, 413, 415, 422),
    201,
    method="PUT",
    dependencies=[AdminAccess],
)
async def create_collection(
    collection: NamePath, request: Request, catalogue: CatalogueDep
) -> CollectionOut:
    """Create a collection from a model file or a snapshot (the admin key)."""
    body, _ = await CREATE_BODY.read(request)
    options = {"factory": body.factory, "filter_fields": body.filter_fields}
    created = await catalogue.create(
        collection, model=body.model, snapshot=body.snapshot, **(options if body.model else {})
    )
    return CollectionOut.model_validate(created)


@operation(router, "GET", "/{collection}", error_responses(400, 401, 403, 404))
async def get_collection(
    collection: CollectionPath, catalogue: CatalogueDep, who: ReaderDep
) -> CollectionOut:
    """One collection (or the one an alias names)."""
    name = catalogue.resolve(collection)
    if not who.may_read([collection, name]):
        raise forbidden(f"read collection {collection!r}")
    return CollectionOut.model_validate(catalogue.describe(name))


@operation(
    router, "DELETE", "/{collection}", error_responses(400, 401, 403, 404, 409),
    dependencies=[AdminAccess],
)  # fmt: skip
async def delete_collection(collection: NamePath, catalogue: CatalogueDep) -> CollectionDeleted:
    """Delete a collection (the admin key; its snapshots are moved aside)."""
    await catalogue.delete(collection)
    return CollectionDeleted(collection=collection, deleted=True)
