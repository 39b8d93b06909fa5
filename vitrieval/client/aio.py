"""`AsyncClient`: the HTTP API's calls as coroutines (httpx.AsyncClient)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, TypeVar

import anyio
import httpx

from .calls import Call
from .exchange import Exchange
from .methods import AsyncClientBase, Methods

T = TypeVar("T")


class AsyncClient(AsyncClientBase, Methods):
    """`Client`'s methods as coroutines, for asyncio (or trio) programs: one client
    serves many calls at once (`asyncio.gather`) over its connection pool. The
    arguments are `Client`'s; `transport` is an `httpx.AsyncBaseTransport`.
    Close it (`await close()`, or `async with`) to free its connections.
    """

    def _connect(self, options: dict[str, Any], transport: httpx.AsyncBaseTransport | None) -> None:
        self._http = httpx.AsyncClient(**options, transport=transport)

    async def _send(self, call: Call[T]) -> T:
        exchange = Exchange(call, self.retry)
        for step in exchange:
            if not isinstance(step, Call):
                await anyio.sleep(step)
                continue
            try:
                exchange.outcome = await self._http.request(**self.request_options(step))
            except httpx.RequestError as exc:
                exchange.outcome = exc
        return exchange.result

    async def close(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
