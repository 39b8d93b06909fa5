"""The client without a vitrieval server: which calls are retried and after how long
(against a tiny HTTP server that fails on cue), connection failures and timeouts, the
keys each call sends, the version check, and what `import vitrieval.client` loads."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from serving import free_port

from vitrieval.client import (
    APIError,
    AsyncClient,
    Client,
    ConnectionFailedError,
    IncompatibleServerError,
    NotFoundError,
    RateLimitedError,
    ServiceUnavailableError,
)

ITEM = {"key": "k", "label": None, "metadata": {}, "has_image": False}
BUSY = (503, {"Retry-After": "0"}, {"detail": "busy", "code": "overloaded"})
BAD_GATEWAY = (502, {}, "<html>bad gateway</html>")
DELETED = (200, {}, {"key": "k", "deleted": True})


class Flaky:
    """An HTTP server on loopback answering from a script: each request takes the
    next (status, headers, body) of `script`, the last one repeating; `requests`
    records (method, path, X-API-Key) of each request, `delay_s` slows every answer."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str], object]] = []
        self.requests: list[tuple[str, str, str | None]] = []
        self.delay_s = 0.0
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                flaky.requests.append((self.command, self.path, self.headers.get("X-API-Key")))
                status, headers, body = flaky.script[
                    min(len(flaky.requests), len(flaky.script)) - 1
                ]
                time.sleep(flaky.delay_s)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except ConnectionError:  # a client that timed out has hung up
                    pass

            do_GET = do_POST = do_DELETE = answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def expect(self, *script: tuple[int, dict[str, str], object]) -> None:
        self.script, self.requests, self.delay_s = list(script), [], 0.0


@pytest.fixture(scope="module")
def flaky() -> Iterator[Flaky]:
    server = Flaky()
    yield server
    server.httpd.shutdown()


@pytest.fixture
def client(flaky: Flaky) -> Iterator[Client]:
    with Client(flaky.url, api_key="write-key", read_key="read-key", retries=2) as c:
        yield c


def test_idempotent_calls_are_retried_until_they_succeed(flaky, client):
    flaky.expect(BUSY, BAD_GATEWAY, DELETED)
    assert client.delete("k").deleted
    assert [r[0] for r in flaky.requests] == ["DELETE"] * 3
    flaky.expect(BUSY, (200, {}, {**ITEM, "replaced": True}))
    assert client.add("k", vector=[1.0], replace=True).replaced
    assert len(flaky.requests) == 2
    flaky.expect((504, {}, ""), (200, {}, {"hits": [], "k": 1, "query": "key", "timings_ms": {}}))
    assert client.search(key="k", k=1).hits == []
    assert len(flaky.requests) == 2


def test_an_add_without_replace_is_never_retried(flaky, client):
    flaky.expect(BUSY, (201, {}, {**ITEM, "replaced": False}))
    with pytest.raises(ServiceUnavailableError) as raised:
        client.add("k", vector=[1.0])
    assert (raised.value.status, raised.value.code) == (503, "overloaded")
    assert len(flaky.requests) == 1


def test_the_retries_are_bounded_and_the_last_error_raised(flaky):
    flaky.expect(BUSY)
    for retries in (0, 1, 3):
        flaky.expect(BUSY)
        with Client(flaky.url, retries=retries) as c, pytest.raises(ServiceUnavailableError):
            c.info()
        assert len(flaky.requests) == retries + 1
    flaky.expect(BAD_GATEWAY)
    with Client(flaky.url, retries=1) as c, pytest.raises(APIError) as raised:
        c.health()
    assert type(raised.value) is APIError
    assert (raised.value.status, raised.value.code) == (502, "http_502")
    assert "bad gateway" in raised.value.detail


def test_retry_after_is_honoured_within_a_bound(flaky, client):
    flaky.expect((429, {"Retry-After": "0.4"}, {"detail": "wait", "code": "busy"}), DELETED)
    started = time.monotonic()
    client.delete("k")
    assert time.monotonic() - started >= 0.4 and len(flaky.requests) == 2
    flaky.expect((429, {"Retry-After": "60"}, {"detail": "wait", "code": "busy"}), DELETED)
    started = time.monotonic()
    with pytest.raises(RateLimitedError) as raised:
        client.delete("k")
    assert time.monotonic() - started < 5 and len(flaky.requests) == 1
    assert (raised.value.code, raised.value.retry_after) == ("busy", 60.0)


def test_client_errors_are_not_retried(flaky, client):
    flaky.expect((404, {}, {"detail": "no item", "code": "unknown_key"}), DELETED)
    with pytest.raises(NotFoundError) as raised:
        client.delete("k")
    assert (raised.value.status, raised.value.code, raised.value.detail) == (
        404,
        "unknown_key",
        "no item",
    )
    assert len(flaky.requests) == 1


def test_a_retried_delete_that_finds_nothing_has_deleted(flaky, client):
    """The first attempt's answer was lost (a 503 after the server acted): the repeat's
    404 means the item is gone, which is what the call asked for. A first-attempt 404
    stays an error (above), and a search's 404 on a repeat stays one too."""
    gone = (404, {}, {"detail": "no item", "code": "unknown_key"})
    flaky.expect(BUSY, gone)
    answer = client.delete("k")
    assert (answer.key, answer.deleted, len(flaky.requests)) == ("k", True, 2)
    flaky.expect(BUSY, gone)
    with pytest.raises(NotFoundError):
        client.search(key="k")


def test_local_inputs_are_checked_or_converted_before_sending(flaky, client):
    from PIL import Image

    flaky.expect((200, {}, {"embedding": [1.0], "dim": 1, "fingerprint": "f", "timings_ms": {}}))
    client.embed(Image.new("CMYK", (8, 8)))  # PNG holds no CMYK: sent as RGB
    for mode in ("CMYK", "F", "YCbCr"):
        client.embed(Image.new(mode, (8, 8)))
    assert len(flaky.requests) == 4
    with pytest.raises(ValueError, match="finite"):
        client.search(vector=[1.0, float("nan")])
    assert len(flaky.requests) == 4  # nothing sent


def test_the_clients_defaults_are_the_servers():
    """Left None, an option takes the server's default; `k` is stated (the call's
    documented signature) and must agree with the server's."""
    import inspect

    from vitrieval.client import calls
    from vitrieval.client.methods import DEFAULT_TIMEOUT_S
    from vitrieval.service.schemas import SearchRequest
    from vitrieval.service.settings import Settings

    assert inspect.signature(calls.search).parameters["k"].default == (
        SearchRequest.model_fields["k"].default
    )
    assert Settings(read_only=True).request_timeout_s < DEFAULT_TIMEOUT_S


def test_reads_send_the_read_key_and_writes_the_write_key(flaky, client):
    flaky.expect(DELETED)
    client.delete("a/b c")
    flaky.script = [(200, {}, ITEM)]
    client.get("a/b c", vector=True)
    assert flaky.requests == [
        ("DELETE", "/v1/items/a/b%20c", "write-key"),
        ("GET", "/v1/items/a/b%20c?vector=true", "read-key"),
    ]
    flaky.expect((200, {}, ITEM))
    with Client(flaky.url, api_key="write-key") as writer:
        writer.get("k")
    assert flaky.requests[0][2] == "write-key"  # the server takes the write key for reads


def test_connection_failures_and_timeouts(flaky):
    attempts = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(request.method)
        raise httpx.ConnectError("refused", request=request)

    with Client("http://vitrieval.invalid", transport=httpx.MockTransport(refuse)) as c:
        with pytest.raises(ConnectionFailedError) as raised:
            c.search(key="k")
        assert len(attempts) == 3 and isinstance(raised.value.__cause__, httpx.ConnectError)
        assert (raised.value.status, raised.value.code) == (0, "connection_failed")
        attempts.clear()
        with pytest.raises(ConnectionFailedError):
            c.add("k", vector=[1.0])
        assert attempts == ["POST"]
    nobody = Client(f"http://127.0.0.1:{free_port()}", retries=0)
    with nobody, pytest.raises(ConnectionFailedError, match="connection_failed"):
        nobody.health()
    flaky.expect(DELETED)
    flaky.delay_s = 0.5
    hasty = Client(flaky.url, timeout=0.1, retries=1)
    with hasty, pytest.raises(ConnectionFailedError) as slow:
        hasty.delete("k")
    assert slow.value.code == "timeout" and len(flaky.requests) == 2


def test_async_retries(flaky):
    async def run() -> None:
        async with AsyncClient(flaky.url, api_key="write-key") as c:
            flaky.expect(BUSY, BUSY, DELETED)
            assert (await c.delete("k")).deleted
            assert len(flaky.requests) == 3
            flaky.expect(BUSY, (201, {}, {**ITEM, "replaced": False}))
            with pytest.raises(ServiceUnavailableError):
                await c.add("k", vector=[1.0])
            assert len(flaky.requests) == 1

    asyncio.run(run())


def info_body(version: str) -> dict:
    model = {
        "file": "m.onnx",
        "backbone": None,
        "pooling": None,
        "embedding_dim": 2,
        "input_size": [32, 32],
        "fingerprint": "f",
        "provider": "CPUExecutionProvider",
    }
    index = {
        "count": 0,
        "deleted": 0,
        "factory": "Flat",
        "dim": 2,
        "metric": "ip",
        "generation": 1,
        "gpu": "cpu",
        "search_params": {},
        "journal_pending": 0,
        "segments": [],
    }
    service = {
        "batching": False,
        "model_calls_at_once": 1,
        "max_batch_size": 1,
        "max_batch_wait_ms": 0.0,
        "max_k": 10,
        "max_body_bytes": 1024,
        "max_pixels": 1024,
        "mutations": False,
        "read_key_required": False,
    }
    return {"version": version, "uptime_s": 1.0, "model": model, "index": index, "service": service}


def test_the_version_check(monkeypatch):
    import vitrieval.client.calls as calls

    monkeypatch.setattr(calls, "__version__", "1.4.2")
    for server, fine in (("1.4.0", True), ("1.4.9rc1", True), ("1.5.0", False), ("2.4.2", False)):
        transport = httpx.MockTransport(lambda r, v=server: httpx.Response(200, json=info_body(v)))
        with Client("http://x", transport=transport) as c:
            if fine:
                assert c.check_version() == server
                continue
            with pytest.raises(IncompatibleServerError) as raised:
                c.check_version()
            assert raised.value.server_version == server and raised.value.client_version == "1.4.2"
            assert isinstance(raised.value, APIError) and raised.value.code == "incompatible_server"
            assert c.info().version == server  # info() itself does not check


def test_importing_the_client_loads_nothing_heavy():
    code = (
        "import sys\n"
        "from vitrieval.client import Client\n"
        "import vitrieval.client.calls as calls\n"
        "calls.search(vector=[1.0, 0.0], image=b'png', filter={'must': []})\n"
        "heavy = ('faiss', 'onnxruntime', 'torch', 'fastapi', 'numpy', 'PIL')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
