"""The request edge (service/middleware.py) on a bare ASGI app: upload slots, the
body memory budget, the body timeout, oversized bodies, URLs that are not UTF-8, and
probes that stay answered when everything else is full."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from vitrieval.service.errors import install_error_handlers
from vitrieval.service.metrics import ServiceMetrics
from vitrieval.service.middleware import LimitsMiddleware, MetricsMiddleware


def edge_app(**limits) -> tuple[FastAPI, asyncio.Event]:
    """An app whose /hold route reads its body, then waits for `release`."""
    app = FastAPI()
    install_error_handlers(app)
    release = asyncio.Event()

    @app.post("/hold")
    async def hold(request: Request) -> dict:
        body = await request.body()
        await release.wait()
        return {"bytes": len(body)}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    limits.setdefault("max_body_bytes", 1000)
    limits.setdefault("timeout_s", 10)
    app.add_middleware(LimitsMiddleware, **limits)
    return app, release


async def _while_held(app: FastAPI, release: asyncio.Event, held: int, then) -> list:
    """Start `held` requests to /hold, let them read their bodies, run `then(client)`,
    release them; returns [then's result, *held responses]."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        holders = [
            asyncio.create_task(client.post("/hold", content=b"x" * 100)) for _ in range(held)
        ]
        await asyncio.sleep(0.1)
        result = await then(client)
        release.set()
        return [result, *await asyncio.gather(*holders)]


def test_body_memory_budget_refuses_with_503_and_probes_still_answer() -> None:
    app, release = edge_app(max_body_memory_bytes=250, upload_slots=10)

    async def then(client: httpx.AsyncClient) -> tuple:
        refused = await client.post("/echo", content=b"y" * 100)  # 2 x 100 held: 300 > 250
        small = await client.post("/echo", content=b"y" * 40)  # 240 fits
        probe = await client.get("/healthz")
        return refused, small, probe

    (refused, small, probe), *held = asyncio.run(_while_held(app, release, 2, then))
    assert refused.status_code == 503 and refused.json()["code"] == "overloaded"
    assert refused.headers["retry-after"] == "1"
    assert small.status_code == 200 and probe.status_code == 200
    assert [h.status_code for h in held] == [200, 200]


def test_requests_past_max_concurrency_get_json_503_but_probes_do_not() -> None:
    app, release = edge_app(max_concurrency=2)

    async def then(client: httpx.AsyncClient) -> tuple:
        return await client.post("/echo", content=b"z"), await client.get("/healthz")

    (busy, probe), *held = asyncio.run(_while_held(app, release, 2, then))
    assert busy.status_code == 503 and "more than 2 requests" in busy.json()["detail"]
    assert probe.status_code == 200
    assert all(h.status_code == 200 for h in held)


def test_a_body_that_stalls_gets_408_after_the_body_timeout() -> None:
    app, _ = edge_app(body_timeout_s=0.3)

    async def stalled() -> httpx.Response:
        async def chunks():
            yield b"a" * 10
            await asyncio.sleep(5)
            yield b"b"

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.post("/echo", content=chunks())

    response = asyncio.run(stalled())
    assert response.status_code == 408
    assert response.json() == {
        "detail": "the body did not arrive within 0.3 s",
        "code": "request_timeout",
    }


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_bodies_get_413_after_the_excess_is_read(chunked) -> None:
    app, _ = edge_app(max_body_bytes=1000)
    seen: list[int] = []

    async def run() -> httpx.Response:
        async def chunks():
            for _ in range(30):
                seen.append(1)
                yield b"c" * 100

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            content = chunks() if chunked else b"c" * 3000
            return await client.post("/echo", content=content)

    response = asyncio.run(run())
    assert response.status_code == 413 and response.json()["code"] == "request_too_large"
    assert response.headers["connection"] == "close"
    if chunked:
        assert len(seen) == 30  # drained to the end (3x the limit is under DRAIN_FACTOR)


def test_urls_that_are_not_utf8_are_422_before_routing() -> None:
    app, _ = edge_app()
    with TestClient(app) as client:
        for url in ("/nowhere/%ED%A0%80", "/healthz?x=%FF"):
            response = client.get(url)
            assert response.status_code == 422 and response.json()["code"] == "invalid_text"
        assert client.get("/healthz?x=%C3%A9").status_code == 200  # é is fine


def test_disconnects_are_counted_apart_from_errors() -> None:
    metrics = ServiceMetrics()
    app, _ = edge_app()
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    async def run() -> None:
        messages = iter(
            [
                {"type": "http.request", "body": b"ab", "more_body": True},
                {"type": "http.disconnect"},
            ]
        )
        sent: list[dict] = []

        async def receive() -> dict:
            return next(messages)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/echo",
            "raw_path": b"/echo",
            "query_string": b"",
            "headers": [(b"content-length", b"10")],
            "http_version": "1.1",
            "scheme": "http",
            "server": ("edge", 80),
            "client": ("c", 1),
            "root_path": "",
            "app": app,
        }
        await app(scope, receive, send)

    asyncio.run(run())
    rendered = metrics.render().decode()
    assert 'vitrieval_client_disconnects_total{route="/echo"} 1.0' in rendered
    assert "vitrieval_request_errors_total{" not in rendered


def test_bodyless_posts_never_free_an_upload_slot_they_did_not_take() -> None:
    app, _ = edge_app(upload_slots=2)
    edge = None

    async def run() -> None:
        nonlocal edge
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            for _ in range(3):  # no Content-Length, no chunked body: the app reads b""
                request = client.build_request("POST", "/echo")
                request.headers.pop("content-length", None)
                assert (await client.send(request)).status_code == 200
        edge = app.middleware_stack
        while not isinstance(edge, LimitsMiddleware):
            edge = edge.app

    asyncio.run(run())
    assert edge.uploading == 0 and edge.in_flight == 0 and edge.body_bytes == 0
