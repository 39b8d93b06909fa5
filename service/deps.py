"""Route dependencies as typed aliases: the loaded service state and the API keys."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Request, Security
from fastapi.security import APIKeyHeader

from vitrieval.index.collections import NAME_PATTERN, NAME_REGEX, DataFolder

from .answers import API_KEY_HEADER
from .catalogue import DEFAULT_ALIAS, Catalogue
from .errors import ApiError
from .keys import KeyRing, Rights
from .reembed_jobs import ReembedJobs
from .settings import Settings
from .state import ServiceState

KEY_SCHEME = "APIKeyHeader"
OPTIONAL_KEY_SCHEME = "OptionalAPIKeyHeader"
"""The read routes' scheme as FastAPI names it; the OpenAPI document states it as
KEY_SCHEME made optional (service/openapi.py), since OpenAPI has no optional scheme."""

_key_header = APIKeyHeader(
    name=API_KEY_HEADER,
    scheme_name=KEY_SCHEME,
    auto_error=False,
    description="the API key: always for adds and deletes, for reads when the server "
    "has a read key (VITRIEVAL_READ_API_KEY)",
)
_read_key_header = APIKeyHeader(
    name=API_KEY_HEADER, scheme_name=OPTIONAL_KEY_SCHEME, auto_error=False
)


def served_catalogue(request: Request) -> Catalogue | None:
    """The data folder's collections; None on a server of one model and index."""
    return getattr(request.app.state, "catalogue", None)


async def get_state(request: Request) -> AsyncIterator[ServiceState]:
    """The state of the collection the request addresses (`/v1/collections/{collection}/
    ...`, or the default one), held open until the request ends."""
    catalogue = served_catalogue(request)
    if catalogue is None:
        collection_of(request)  # a 404 for any name but the one collection's
        state: ServiceState | None = getattr(request.app.state, "service", None)
        if state is None or not state.ready:
            raise ApiError(503, "not_ready", "the model and index are still loading")
        yield state
        return
    if not catalogue.ready:
        raise ApiError(503, "not_ready", "the server is still starting")
    async with catalogue.using(collection_of(request)) as state:
        yield state


ServiceDep = Annotated[ServiceState, Depends(get_state)]


async def get_catalogue(request: Request) -> Catalogue:
    """The data folder's collections; a 400 on a server of one model and index."""
    catalogue = served_catalogue(request)
    if catalogue is None:
        raise ApiError(
            400,
            "no_data_folder",
            "this server serves one index (--model, --index): collections, aliases and "
            "snapshots need a data folder (vitrieval-serve --data DIR)",
        )
    if not catalogue.ready:
        raise ApiError(503, "not_ready", "the server is still starting")
    return catalogue


CatalogueDep = Annotated[Catalogue, Depends(get_catalogue)]


@dataclass(frozen=True)
class Addressed:
    """The data folder and the collection (an alias resolved) a request addresses."""

    folder: DataFolder
    collection: str
    jobs: ReembedJobs


def path_name(description: str) -> Any:
    """A name in a route's path (a collection's or an alias's), checked: a 422 for a
    name none can have."""
    return Annotated[str, Path(pattern=NAME_REGEX, description=description)]


CollectionPath = path_name("a collection, or an alias")


async def addressed(request: Request, collection: CollectionPath) -> Addressed:
    catalogue = await get_catalogue(request)
    return Addressed(catalogue.folder, collection_of(request), catalogue.reembed_jobs)


AddressedDep = Annotated[Addressed, Depends(addressed)]


def collection_of(request: Request) -> str:
    """The collection the request addresses: its path's name (an alias resolved), else
    the default one; on a server of one index, that index is the collection
    DEFAULT_ALIAS."""
    resolved = getattr(request.state, "collection", None)
    if resolved is not None:  # resolved once per request: an alias switch meanwhile
        return resolved  # must not send it elsewhere than where its key was checked
    name = request.path_params.get("collection")
    if name is not None and not NAME_PATTERN.fullmatch(name):
        # said here: FastAPI reports the path's pattern only once every dependency ran
        raise ApiError(422, "invalid_request", f"{name!r} is not a collection or alias name")
    catalogue = served_catalogue(request)
    if catalogue is not None:
        request.state.collection = catalogue.resolve(name)
        return request.state.collection
    if name not in (None, DEFAULT_ALIAS):
        raise ApiError(
            404,
            "unknown_collection",
            f"no collection or alias named {name!r}: this server serves one index, the "
            f"collection {DEFAULT_ALIAS!r}",
        )
    return DEFAULT_ALIAS


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing says nothing about the key."""
    if given is None:
        return False
    return secrets.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class Caller:
    """Who sent a request, by its key: the admin key (VITRIEVAL_API_KEY: everything),
    the read key (every collection's reads), a key of the keys file (its `rights`), or
    none of them."""

    admin: bool
    reads_all: bool  # the admin or read key, or a server whose reads need no key
    rights: Rights | None

    @property
    def known(self) -> bool:
        return self.admin or self.reads_all or self.rights is not None

    def may_read(self, names: Iterable[str]) -> bool:
        return self.reads_all or any(self.rights.allows(n) for n in names if self.rights)

    def may_write(self, names: Iterable[str]) -> bool:
        return self.admin or any(self.rights.allows(n, write=True) for n in names if self.rights)


def caller(request: Request, key: str | None) -> Caller:
    """Who `key` is (every key compared in constant time, no early exit)."""
    settings = _settings(request)
    keys: KeyRing | None = getattr(request.app.state, "keys", None)
    admin = settings.api_key is not None and _matches(key, settings.api_key.get_secret_value())
    read = settings.read_api_key is not None and _matches(
        key, settings.read_api_key.get_secret_value()
    )
    open_reads = settings.read_api_key is None and keys is None
    rights = keys.rights(key) if keys is not None else None
    return Caller(admin, admin or read or open_reads, rights)


def _addressed(request: Request) -> list[str]:
    """The names a request's collection goes by: the one in its path, and the collection
    it resolves to (a key given an alias follows it to whichever collection it names)."""
    collection = collection_of(request)
    name = request.path_params.get("collection")
    catalogue = served_catalogue(request)
    if name is None and catalogue is not None:
        name = catalogue.default_name  # the plain routes go by the default's name
    return [collection] if name in (None, collection) else [name, collection]


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        f"a valid API key is required in the {API_KEY_HEADER} header",
        headers={"WWW-Authenticate": API_KEY_HEADER},
    )


def forbidden(what: str) -> ApiError:
    """403: the key is known, but may not do `what`."""
    return ApiError(403, "forbidden", f"this API key may not {what}")


def _refuse_read_only(request: Request) -> None:
    if _settings(request).read_only:
        raise ApiError(403, "read_only", "this server is read-only (started with --read-only)")


def _require(request: Request, key: str | None, *, write: bool) -> None:
    """The key may read (or `write`) the collection the request addresses."""
    if write:
        _refuse_read_only(request)
    who = caller(request, key)
    if who.admin or (who.reads_all and not write):
        return
    if who.rights is None:
        raise _unauthorized()
    names = _addressed(request)
    if not (who.may_write(names) if write else who.may_read(names)):
        raise forbidden(f"{'change' if write else 'read'} collection {names[0]!r}")


async def require_write_key(
    request: Request, key: Annotated[str | None, Security(_key_header)] = None
) -> None:
    _require(request, key, write=True)


async def require_read_key(
    request: Request, key: Annotated[str | None, Security(_read_key_header)] = None
) -> None:
    _require(request, key, write=False)


async def require_admin_key(
    request: Request, key: Annotated[str | None, Security(_key_header)] = None
) -> None:
    """The admin key alone: creating and deleting collections and aliases."""
    _refuse_read_only(request)
    who = caller(request, key)
    if not who.admin:
        if who.rights is not None:
            raise forbidden("create or delete collections and aliases (the admin key may)")
        raise _unauthorized()


async def reader(
    request: Request, key: Annotated[str | None, Security(_read_key_header)] = None
) -> Caller:
    """The caller of a route that lists what a key may read (any known key, or none
    where reads need none)."""
    who = caller(request, key)
    if not who.known:
        raise _unauthorized()
    return who


# the checks are async (they never block): a sync dependency would cost each request a
# hop to the thread pool, a third of a millisecond on a busy 2-core host (bench/many_collections.py)
WriteAccess = Depends(require_write_key)
ReadAccess = Depends(require_read_key)
AdminAccess = Depends(require_admin_key)
ReaderDep = Annotated[Caller, Depends(reader)]
