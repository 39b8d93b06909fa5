"""ASGI middleware: request body limit, request timeout, and per-request metrics.

Pure ASGI (no BaseHTTPMiddleware) so that bodies are never buffered here: the limit
is enforced on Content-Length before the route runs and again on the bytes actually
received, for chunked uploads that announce no length.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, error_response
from .metrics import ServiceMetrics


def _too_large(limit: int) -> str:
    return f"request body exceeds the limit of {limit:,} bytes"


class _BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, "request_too_large", _too_large(limit))


class LimitsMiddleware:
    """413 for bodies over `max_body_bytes`; 408/503 for requests over `timeout_s`.

    A request still receiving its body when the time is up is the client's slowness
    (408); one whose body had arrived is the server's (503, with Retry-After).
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            await _BodyTooLargeResponse(limit)(scope, receive, send)
            return

        received = 0
        body_done = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        with anyio.move_on_after(self.timeout_s) as scope_timer:
            await self.app(scope, counting_receive, tracking_send)
        if scope_timer.cancelled_caught and not started:
            if body_done or length == 0 or scope["method"] in ("GET", "HEAD", "DELETE"):
                response = error_response(
                    503,
                    "timeout",
                    f"the request took longer than {self.timeout_s:g} s",
                )
                response.headers["Retry-After"] = "1"
            else:
                response = error_response(
                    408, "request_timeout", f"the body did not arrive within {self.timeout_s:g} s"
                )
            await response(scope, receive, send)


class _BodyTooLargeResponse:
    def __init__(self, limit: int) -> None:
        self.response = error_response(413, "request_too_large", _too_large(limit))
        # the body is not read: tell the client this connection ends here
        self.response.headers["Connection"] = "close"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class MetricsMiddleware:
    """Counts requests and errors and times them, labelled by the route's path template
    (so /v1/items/{key} is one series, not one per key)."""

    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, status_send)
        finally:
            # any token is a valid HTTP method: bound the label's values
            method = scope["method"] if scope["method"] in _METHODS else "OTHER"
            self.metrics.observe_request(
                method, _route_template(scope), status, time.perf_counter() - started
            )


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _route_template(scope: Scope) -> str:
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
