"""The search service as a real `vitrieval-serve` process on loopback: crash recovery
under concurrent adds (SIGKILL), hostile uploads in bounded memory, and schemathesis
fuzzing of the OpenAPI schema."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from hostile_images import png_bomb
from PIL import Image
from serving import Server

KEY = "server-test-key-0123"
AUTH = {"X-API-Key": KEY}
ENV = {"VITRIEVAL_API_KEY": KEY}


def distinct_image(seed: int) -> bytes:
    """A small PNG unlike the others: a random 4x4 colour grid blown up to 32x32."""
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(grid).resize((32, 32), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


async def add_concurrently(
    url: str, images: dict[str, bytes], clients: int, acked: list[str], failed: list[str]
) -> None:
    """POST every image from `clients` concurrent clients until done or the server dies;
    `acked` collects the keys answered 201."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for key in images:
        queue.put_nowait(key)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while not queue.empty():
                key = queue.get_nowait()
                try:
                    response = await http.post(
                        "/v1/items",
                        headers=AUTH,
                        files={"image": (f"{key}.png", images[key], "image/png")},
                        data={"key": key, "label": key[-1]},
                    )
                except httpx.TransportError:
                    failed.append(key)
                    return  # the server is gone
                if response.status_code == 201:
                    acked.append(key)
                else:
                    failed.append(key)

    await asyncio.gather(*(client() for _ in range(clients)))


def test_sigkill_during_1000_concurrent_adds_keeps_every_acknowledged_add(
    digits_gallery, served_index
) -> None:
    images = {f"new/{i:04d}": distinct_image(i) for i in range(1000)}
    acked: list[str] = []
    failed: list[str] = []
    # a checkpoint (full save) every 150 adds: the kill lands between, or during, saves
    env = {**ENV, "VITRIEVAL_CHECKPOINT_EVERY": "150"}
    server = Server(digits_gallery["model"], served_index, env=env).wait_ready()

    async def run() -> None:
        adding = asyncio.create_task(add_concurrently(server.url, images, 32, acked, failed))
        while len(acked) < 450 and not adding.done():
            await asyncio.sleep(0.01)
        server.kill()
        await adding

    asyncio.run(run())
    assert server.process.returncode == -9
    print(f"{len(acked)} adds acknowledged before SIGKILL, {len(failed)} cut off")
    assert 450 <= len(acked) < 1000

    with Server(digits_gallery["model"], served_index, env=ENV) as restarted:
        http = httpx.Client(base_url=restarted.url, timeout=30)
        info = http.get("/v1/info").json()["index"]
        present = set()
        for key in images:
            got = http.get(f"/v1/items/{key}")
            assert got.status_code in (200, 404)
            if got.status_code == 200:
                present.add(key)
                assert got.json()["label"] == key[-1] and got.json()["has_image"]
        assert set(acked) <= present, f"lost: {sorted(set(acked) - present)[:5]}"
        # unacknowledged adds are either absent or complete, never half there
        assert info["count"] == 120 + len(present)
        for key in present:
            hits = http.post(
                "/v1/search",
                files={"image": ("q.png", images[key], "image/png")},
                data={"k": "1"},
            ).json()["hits"]
            assert hits[0]["key"] == key, key
        print(f"after restart: {len(present)} present ({len(present) - len(acked)} unacknowledged)")


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_hostile_uploads_are_refused_in_bounded_memory(digits_gallery, served_index) -> None:
    """A 20000x20000 PNG (400 MB decoded) and a 30 MB body: refused without the server's
    peak memory growing by anything like their decoded size."""
    bomb = png_bomb()
    with Server(digits_gallery["model"], served_index, env=ENV) as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        warm = http.post("/v1/search", json={"key": "1/digits_00001.png", "k": 1})
        assert warm.status_code == 200
        before = peak_rss_kib(server.process.pid)
        timings = {}
        for name, kwargs, status in (
            ("bomb", {"files": {"image": ("b.png", bomb, "image/png")}}, 413),
            ("30 MB body", {"files": {"image": ("b.png", b"\0" * (30 << 20), "image/png")}}, 413),
            ("truncated", {"files": {"image": ("t.png", bomb[:5000], "image/png")}}, 413),
            ("text", {"files": {"image": ("t.png", b"hello " * 100, "image/png")}}, 415),
        ):
            started = time.perf_counter()
            response = http.post("/v1/search", **kwargs)
            timings[name] = time.perf_counter() - started
            assert response.status_code == status, (name, response.text)
            assert response.json()["detail"]
        grown_mib = (peak_rss_kib(server.process.pid) - before) / 1024
        print("seconds per refusal:", {k: round(v, 3) for k, v in timings.items()})
        print(f"server peak memory grew by {grown_mib:.1f} MiB")
        assert grown_mib < 100, f"peak memory grew by {grown_mib:.0f} MiB"


def test_schemathesis_finds_no_server_error_or_schema_violation(
    digits_gallery, served_index, tmp_path
) -> None:
    with Server(digits_gallery["model"], served_index, env=ENV) as server:
        command = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,"
            "response_schema_conformance,response_headers_conformance",
            "--header",
            f"X-API-Key: {KEY}",
            "--max-examples",
            "100",
            "--phases",
            "examples,coverage,fuzzing",
            "--workers",
            "1",
            "--seed",
            "1",
            "--suppress-health-check",
            "all",
        ]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,  # schemathesis keeps its state in ./.schemathesis
            env={**os.environ, "NO_COLOR": "1"},
        )
        output = result.stdout + result.stderr
        print(output[-3000:])
        assert result.returncode == 0, output[-6000:]
        server_log = server.output()
        assert "Traceback" not in server_log, server_log[-3000:]


def test_a_body_that_never_finishes_gets_408(digits_gallery, served_index) -> None:
    """Slow-loris uploads do not hold a request open forever."""
    import socket

    env = {**ENV, "VITRIEVAL_REQUEST_TIMEOUT_S": "1"}
    with Server(digits_gallery["model"], served_index, env=env) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"k": 1,'
            )
            started = time.perf_counter()
            answer = sock.recv(65536).decode()
            waited = time.perf_counter() - started
            while not answer.endswith("}"):  # the body may come in a second packet
                more = sock.recv(65536).decode()
                if not more:
                    break
                answer += more
        assert answer.startswith("HTTP/1.1 408"), answer
        assert '"code":"request_timeout"' in answer
        print(f"408 after {waited:.2f} s")
