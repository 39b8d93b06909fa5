"""`Client`: the HTTP API's calls, blocking (httpx.Client)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, TypeVar

import httpx

from .calls import Call
from .exchange import Exchange
from .methods import Methods, SyncClientBase

T = TypeVar("T")


class Client(SyncClientBase, Methods):
    """A client of a vitrieval server at `base_url` (e.g. `http://127.0.0.1:8000`).

    `api_key`: the write key, sent with adds and deletes, and with reads when no
    `read_key` is given. `read_key`: the key of a server that asks one for reads.
    `timeout`: seconds per attempt (a float or an `httpx.Timeout`). `retries`: extra
    attempts of an idempotent call after a connection failure, 429, 502, 503 or 504.
    `transport`: an `httpx.BaseTransport` to send through (tests, proxies).
    `collection`: on a data folder server, the collection (or alias) the item, search
    and evaluate calls address (None: the server's default; `in_collection` makes a
    copy for another).
    Close it (`close()`, or use it as a context manager) to free its connections.
    """

    def _connect(self, options: dict[str, Any], transport: httpx.BaseTransport | None) -> None:
        self._http = httpx.Client(**options, transport=transport)

    def _send(self, call: Call[T]) -> T:
        exchange = Exchange(call, self.retry)
        for step in exchange:
            if isinstance(step, Call):
                exchange.outcome = self._attempt(step)
            else:
                time.sleep(step)
        return exchange.result

    def _attempt(self, call: Call[T]) -> httpx.Response | httpx.RequestError:
        try:
            return self._http.request(**self.request_options(call))
        except httpx.RequestError as exc:
            return exc

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
