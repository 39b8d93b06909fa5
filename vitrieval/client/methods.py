"""The client's methods, defined once for `Client` and `AsyncClient`.

Each method is a function of `vitrieval.client.calls` (its parameters, types and
docstring) turned into a method by `method()`: on a `SyncClientBase` it sends the call
and returns the answer, on an `AsyncClientBase` it is a coroutine that does. The two
clients differ only in how they send (vitrieval.client.sync, vitrieval.client.aio).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Generic, ParamSpec, Self, TypeVar, overload

import httpx

from vitrieval._version import __version__
from vitrieval.service.answers import API_KEY_HEADER

from . import calls, collection_calls
from .calls import Call
from .exchange import RetryPolicy

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0
"""Longer than the server's own request limit (its `request_timeout_s` setting;
tests/test_client_retries.py holds the two apart), so that a slow call ends with the
server's 503 `timeout`, which says what happened, not a client timeout."""


class ClientBase:
    """What both clients hold and how they are made: the keys, the retry policy and
    the httpx client (`Client`'s docstring describes the arguments)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        read_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
        retries: int = 2,
        transport: Any = None,
        collection: str | None = None,
    ) -> None:
        self.api_key = api_key
        self.read_key = read_key
        self.collection = collection
        self.retry = RetryPolicy(retries=retries)
        self._connect(self.http_options(base_url, timeout), transport)

    def _connect(self, options: dict[str, Any], transport: Any) -> None:
        """Open the httpx client (sync or async) with `options` over `transport`."""
        raise NotImplementedError

    @staticmethod
    def http_options(base_url: str, timeout: float | httpx.Timeout | None) -> dict[str, Any]:
        """The keyword arguments of the httpx client, sync or async."""
        return {
            "base_url": base_url,
            "timeout": timeout,
            "headers": {"User-Agent": f"vitrieval-client/{__version__}"},
        }

    def request_options(self, call: Call[Any]) -> dict[str, Any]:
        """The keyword arguments of httpx's `request()` for `call`: writes send the
        write key, reads the read key or, without one, the write key (which the
        server accepts for reads too)."""
        key = self.api_key if call.write else (self.read_key or self.api_key)
        return {
            "method": call.method,
            "url": self.addressed(call.path),
            "params": call.params,
            "json": call.json,
            "headers": {API_KEY_HEADER: key} if key else None,
        }

    def addressed(self, path: str) -> str:
        """`path` in the client's collection: /v1/search is
        /v1/collections/{collection}/search (the collection and alias routes, which
        name their collections, and the probes stay as they are)."""
        if self.collection is None or not path.startswith("/v1/"):
            return path
        if path.startswith((collection_calls.COLLECTIONS, collection_calls.ALIASES)):
            return path
        where = collection_calls.api_path(collection_calls.COLLECTIONS, self.collection)
        return where + path.removeprefix("/v1")

    def in_collection(self, collection: str | None) -> Self:
        """This client addressing `collection` (a name or an alias; None: the server's
        default): a copy sharing its connections, closed with it."""
        other = copy.copy(self)
        other.collection = collection
        return other


class SyncClientBase(ClientBase):
    """A client whose methods block: `Client` (vitrieval.client.sync) sends."""

    def _send(self, call: Call[T]) -> T:
        raise NotImplementedError


class AsyncClientBase(ClientBase):
    """A client whose methods are coroutines: `AsyncClient` (vitrieval.client.aio)."""

    async def _send(self, call: Call[T]) -> T:
        raise NotImplementedError


class _Method(Generic[P, T]):
    """A call builder as a method: sends what it builds, through the instance."""

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self.build = build
        functools.update_wrapper(self, build)
        # help() and inspect show the method's answer, not the builder's Call[answer]
        signature = inspect.signature(build)
        answer = signature.return_annotation
        if isinstance(answer, str) and answer.startswith("Call[") and answer.endswith("]"):
            answer = answer[len("Call[") : -1]
        self.__signature__ = signature.replace(return_annotation=answer)

    def __call__(self, client: ClientBase, /, *args: Any, **kwargs: Any) -> Any:
        """`Client.search(client, ...)`: the method called through the class."""
        return self.__get__(client)(*args, **kwargs)

    def _bound(self, send: Callable[P, Any]) -> Callable[P, Any]:
        functools.update_wrapper(send, self.build)
        send.__signature__ = self.__signature__  # type: ignore[attr-defined]
        return send

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Method[P, T]: ...

    @overload
    def __get__(
        self, obj: AsyncClientBase, owner: type | None = None
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    @overload
    def __get__(self, obj: SyncClientBase, owner: type | None = None) -> Callable[P, T]: ...

    def __get__(self, obj: ClientBase | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        build = self.build
        if isinstance(obj, AsyncClientBase):

            async def send_async(*args: P.args, **kwargs: P.kwargs) -> T:
                return await obj._send(build(*args, **kwargs))

            return self._bound(send_async)
        if not isinstance(obj, SyncClientBase):
            raise TypeError(f"{type(obj).__name__} is not a client")

        def send(*args: P.args, **kwargs: P.kwargs) -> T:
            return obj._send(build(*args, **kwargs))

        return self._bound(send)


def method(build: Callable[P, Call[T]]) -> _Method[P, T]:
    """`build` (a function of vitrieval.client.calls) as a client method."""
    return _Method(build)


class Methods:
    """The API's calls, grouped by route; vitrieval.client.calls documents each."""

    search, embed = method(calls.search), method(calls.embed)  # /v1/search, /v1/embed
    recommend = method(calls.recommend)  # /v1/recommend
    add, get, delete = method(calls.add), method(calls.get), method(calls.delete)
    thumbnail = method(calls.thumbnail)  # /v1/items/{key}/thumbnail
    scroll = method(calls.scroll)  # /v1/scroll
    item_duplicates = method(calls.item_duplicates)  # /v1/items/{key}/duplicates
    start_duplicates = method(calls.start_duplicates)  # POST /v1/duplicates
    duplicates_job = method(calls.duplicates_job)  # GET /v1/duplicates/{job}
    evaluate = method(calls.evaluate)  # /v1/evaluate
    info, health, readiness = method(calls.info), method(calls.health), method(calls.readiness)
    metrics, check_version = method(calls.metrics), method(calls.check_version)
    # a data folder server's collections, aliases and snapshots (collection_calls)
    collections = method(collection_calls.collections)  # GET /v1/collections
    get_collection = method(collection_calls.get_collection)  # GET /v1/collections/{name}
    create_collection = method(collection_calls.create_collection)  # PUT the same
    delete_collection = method(collection_calls.delete_collection)  # DELETE the same
    aliases, set_alias = method(collection_calls.aliases), method(collection_calls.set_alias)
    delete_alias = method(collection_calls.delete_alias)  # DELETE /v1/aliases/{alias}
    promote = method(collection_calls.promote)  # POST /v1/aliases/{alias}/promote
    start_reembed = method(collection_calls.start_reembed)  # POST .../reembed
    reembed_job = method(collection_calls.reembed_job)  # GET .../reembed/{job}
    cancel_reembed = method(collection_calls.cancel_reembed)  # DELETE .../reembed/{job}
    create_snapshot = method(collection_calls.create_snapshot)  # POST .../snapshots
    snapshots = method(collection_calls.snapshots)  # GET .../snapshots
    download_snapshot = method(collection_calls.download_snapshot)  # GET .../{snapshot}
    delete_snapshot = method(collection_calls.delete_snapshot)  # DELETE .../{snapshot}
