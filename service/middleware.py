"""ASGI middleware: the request edge (limits, overload, timeouts) and per-request metrics.

Pure ASGI (no BaseHTTPMiddleware) so that bodies are never buffered here. What the
edge enforces, in order, every answer a JSON error body:

- a URL whose percent-encoding is not UTF-8 text: 422 before routing;
- requests in flight beyond `max_concurrency`: 503 at once (health, readiness and
  metrics routes are exempt, so probes keep answering under overload);
- bodies still arriving beyond `upload_slots`: 503 at once; a slot is held only while
  the body arrives, so a client that sends headers and holds back its body costs one
  slot for at most `body_timeout_s`, then gets a 408;
- bodies held in memory by requests in flight beyond `max_body_memory_bytes` (counted
  from Content-Length, or as `max_body_bytes` for a chunked body): 503 at once, so
  many large uploads cannot add up past the memory budget;
- a body over `max_body_bytes`: 413, from Content-Length before the route runs or on
  the bytes received for chunked uploads. The excess is read and dropped (up to
  `DRAIN_FACTOR` times the limit) before answering, because closing a socket with
  unread bytes makes the kernel send a reset that destroys the 413 on its way;
- a request slower than `timeout_s` overall: 503 (the body had arrived) or 408.

A client that hangs up before its answer is not a server error: the request is
counted in `vitrieval_client_disconnects_total`, not as a 5xx, and logs nothing.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import unquote_to_bytes

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import CLIENT_CLOSED_REQUEST, ApiError, error_response
from .metrics import ServiceMetrics
from .settings import Settings

DRAIN_FACTOR = 4
"""An oversized body up to this multiple of the limit is read and dropped so that the
client receives its 413; a larger one gets the 413 and the connection is closed."""

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
"""Answered whatever the load: probes must not fail because uploads are queued."""


def _too_large(limit: int) -> str:
    return f"request body exceeds the limit of {limit:,} bytes"


class _BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, "request_too_large", _too_large(limit), {"Connection": "close"})


class _BodyTimeout(ApiError):
    def __init__(self, seconds: float) -> None:
        super().__init__(
            408,
            "request_timeout",
            f"the body did not arrive within {seconds:g} s",
            {"Connection": "close"},
        )


_SETTINGS = Settings.model_fields  # the defaults of the limits, stated once there


class LimitsMiddleware:
    """The request edge described in the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        timeout_s: float,
        body_timeout_s: float | None = None,
        upload_slots: int = _SETTINGS["upload_slots"].default,
        max_concurrency: int = _SETTINGS["max_concurrency"].default,
        max_body_memory_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.body_timeout_s = body_timeout_s if body_timeout_s is not None else timeout_s
        self.upload_slots = upload_slots
        self.max_concurrency = max_concurrency
        self.max_body_memory_bytes = max_body_memory_bytes or 64 * max_body_bytes
        self.body_bytes = 0  # announced body sizes of the requests in flight
        self.uploading = 0  # requests whose body is still arriving
        self.in_flight = 0  # requests being handled (exempt routes not counted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = _url_problem(scope)
        if problem:
            await error_response(422, "invalid_text", problem)(scope, receive, send)
            return
        if scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_concurrency:
            await _overloaded(f"more than {self.max_concurrency} requests at once")(
                scope, receive, send
            )
            return
        self.in_flight += 1
        try:
            await self._handle(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        length = _content_length(scope)
        has_body = (length or 0) > 0 or _is_chunked(scope)
        held = 0 if not has_body else min(length, limit) if length is not None else limit
        refusal = None
        if has_body and self.uploading >= self.upload_slots:
            refusal = f"more than {self.upload_slots} uploads arriving at once"
        elif held and self.body_bytes + held > self.max_body_memory_bytes:
            refusal = f"request bodies in memory would pass {self.max_body_memory_bytes:,} bytes"
        if refusal:
            response = _overloaded(refusal)
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        body = _BodyReader(receive, limit, self.body_timeout_s, length)
        if not has_body:
            body.released = True  # it holds no upload slot: nothing to give back
        self.body_bytes += held
        if has_body:
            self.uploading += 1
        try:
            if length is not None and length > limit:
                # the body is not wanted: read and drop what is cheap to, then answer
                if not _expects_continue(scope) and length <= DRAIN_FACTOR * limit:
                    await body.drain()
                response = error_response(413, "request_too_large", _too_large(limit))
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
            await self._run(scope, body, send)
        finally:
            self.body_bytes -= held
            if has_body and not body.released:
                self.uploading -= 1
                body.released = True

    async def _run(self, scope: Scope, body: _BodyReader, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        def body_arrived() -> None:
            if not body.released:
                self.uploading -= 1
                body.released = True

        body.on_complete = body_arrived
        with anyio.move_on_after(self.timeout_s) as scope_timer:
            await self.app(scope, body.receive, tracking_send)
        if scope_timer.cancelled_caught and not started:
            if body.done or body.length == 0 or scope["method"] in ("GET", "HEAD", "DELETE"):
                response = error_response(
                    503, "timeout", f"the request took longer than {self.timeout_s:g} s"
                )
                response.headers["Retry-After"] = "1"
            else:
                response = error_response(
                    408, "request_timeout", f"the body did not arrive within {self.timeout_s:g} s"
                )
            await response(scope, body.receive, send)


class _BodyReader:
    """The app's `receive`: counts body bytes against the limit, times the body out,
    and reports when it is complete (so the upload slot is given back)."""

    def __init__(self, receive: Receive, limit: int, timeout_s: float, length: int | None):
        self._receive = receive
        self.limit = limit
        self.length = length
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.received = 0
        self.done = length == 0
        self.released = False
        self.on_complete: Any = None

    async def receive(self) -> Message:
        if self.done:
            return await self._receive()  # http.disconnect, when the client leaves
        message = await self._next()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                if self.received <= DRAIN_FACTOR * self.limit:
                    await self.drain()
                raise _BodyTooLarge(self.limit)
            self._finished(not message.get("more_body", False))
        elif message["type"] == "http.disconnect":
            self._finished(True)
        return message

    async def drain(self) -> None:
        """Read and drop the rest of the body (bounded by DRAIN_FACTOR x the limit and
        the body timeout), so the answer that follows reaches the client."""
        with anyio.move_on_after(max(0.0, self.deadline - time.monotonic())):
            while not self.done and self.received <= DRAIN_FACTOR * self.limit:
                message = await self._receive()
                if message["type"] != "http.request":
                    break
                self.received += len(message.get("body", b""))
                self._finished(not message.get("more_body", False))

    async def _next(self) -> Message:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _BodyTimeout(self.timeout_s)
        with anyio.move_on_after(remaining) as timer:
            message = await self._receive()
        if timer.cancelled_caught:
            raise _BodyTimeout(self.timeout_s)
        return message

    def _finished(self, done: bool) -> None:
        if done and not self.done:
            self.done = True
            if self.on_complete is not None:
                self.on_complete()


def _overloaded(why: str) -> Any:
    response = error_response(503, "overloaded", f"the server is busy ({why}); retry shortly")
    response.headers["Retry-After"] = "1"
    return response


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _is_chunked(scope: Scope) -> bool:
    return b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()


def _expects_continue(scope: Scope) -> bool:
    return (_header(scope, b"expect") or b"").lower() == b"100-continue"


def _url_problem(scope: Scope) -> str | None:
    """Why the URL's percent-encoded path or query is not UTF-8 text (None if it is).
    The server's own decoding replaces such bytes silently, which would make a key
    like %ED%A0%80 (an encoded surrogate) look up a different key."""
    raw_path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogatepass")
    for part, what in ((raw_path, "path"), (scope.get("query_string", b""), "query")):
        try:
            unquote_to_bytes(part.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            return f"the URL's {what} holds percent-encoded bytes that are not UTF-8 text"
    return None


class MetricsMiddleware:
    """Counts requests and errors and times them, labelled by the route's path template
    (so /v1/items/{key} is one series, not one per key). A request whose client hung
    up before the answer is counted as a disconnect, not by its status."""

    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        disconnected = False
        started = time.perf_counter()

        async def watching_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
            return message

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, watching_receive, status_send)
        finally:
            route = _route_template(scope)
            if disconnected and (status >= 500 or status == CLIENT_CLOSED_REQUEST):
                self.metrics.observe_disconnect(route)
            else:
                # any token is a valid HTTP method: bound the label's values
                method = scope["method"] if scope["method"] in _METHODS else "OTHER"
                self.metrics.observe_request(method, route, status, time.perf_counter() - started)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _route_template(scope: Scope) -> str:
    route: Any = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
