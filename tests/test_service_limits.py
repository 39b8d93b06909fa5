"""The service's limits against a real `vitrieval-serve` on loopback: images whose
decoding would blow up memory, connections that hold their body back, clients that
hang up, oversized bodies, a port in use and an altered journal. Every answer is JSON;
none is a 5xx."""

from __future__ import annotations

import asyncio
import io
import socket
import sqlite3
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from serving import Server, free_port

from vitrieval.index.store._journal import JOURNAL_FILE

KEY = "server-test-key-0123"
AUTH = {"X-API-Key": KEY}
ENV = {"VITRIEVAL_API_KEY": KEY}
MIB = 2**20


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """The process's resident memory now (VmRSS) or its high-water mark (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def reset_peak(pid: int) -> None:
    """Start a new high-water mark (Linux: writing 5 to clear_refs resets VmHWM)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")


def strip_png(width: int, height: int) -> bytes:
    """A greyscale PNG of width x height, built row by row: a few KB whatever its size."""
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    compressor = zlib.compressobj(9)
    row = bytes(width + 1)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", data)
        + png_chunk(b"IEND", b"")
    )


def palette_alpha_png(side: int = 6324) -> bytes:
    """A palette PNG with a transparent colour, side x side (about 40 MP), ~40 KB: 40 MB
    as decoded indices, 160 MB if ever converted to RGBA whole."""
    image = Image.new("P", (side, side), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    image.paste(1, (side // 4, side // 4, side // 2, side // 2))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", transparency=0, optimize=True)
    return buffer.getvalue()


def upload(data: bytes, name: str = "q.png") -> dict:
    return {"files": {"image": (name, data, "application/octet-stream")}, "data": {"k": "3"}}


@pytest.fixture
def server(digits_gallery, served_index):
    with Server(digits_gallery["model"], served_index, env=ENV) as running:
        yield running
    assert "Traceback" not in running.output(), running.output()[-3000:]


def test_extreme_aspect_ratios_are_refused_before_decoding(server) -> None:
    http = httpx.Client(base_url=server.url, timeout=60)
    assert http.post("/v1/search", json={"key": "1/digits_00001.png", "k": 1}).status_code == 200
    reset_peak(server.process.pid)
    before = rss_kib(server.process.pid, "VmHWM")
    for width, height in ((2_000_000, 1), (1, 2_000_000), (40_000_000, 1), (5000, 20)):
        response = http.post("/v1/search", **upload(strip_png(width, height)))
        assert response.status_code == 422, (width, height, response.text)
        assert response.json()["code"] == "unsupported_image_shape"
        assert "100:1" in response.json()["detail"]
    grown = (rss_kib(server.process.pid, "VmHWM") - before) / 1024
    print(f"peak grew by {grown:.1f} MiB")
    assert grown < 64
    # a panorama within the limit is searched as usual
    assert http.post("/v1/search", **upload(strip_png(3000, 300))).status_code == 200


def test_small_files_that_decode_large_stay_within_the_decode_budget(
    digits_gallery, served_index
) -> None:
    """Eight 40 MP palette+alpha PNGs at once: answered, the server's peak memory within
    its decode budget, and the memory given back afterwards."""
    budget = 128 * MIB
    env = {**ENV, "VITRIEVAL_DECODE_MEMORY_BYTES": str(budget)}
    data = palette_alpha_png()
    assert len(data) < 100_000
    with Server(digits_gallery["model"], served_index, env=env) as server:
        pid = server.process.pid
        http = httpx.Client(base_url=server.url, timeout=60)
        warm = http.post("/v1/search", **upload(data))  # first use maps code, arenas
        assert warm.status_code == 200, warm.text
        time.sleep(0.5)
        baseline = rss_kib(pid)
        reset_peak(pid)

        async def eight() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(
                    *(client.post("/v1/search", **upload(data)) for _ in range(8))
                )

        responses = asyncio.run(eight())
        assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
        peak_growth = (rss_kib(pid, "VmHWM") - baseline) * 1024
        time.sleep(0.5)
        after = rss_kib(pid)
        print(
            f"baseline {baseline / 1024:.0f} MiB, peak +{peak_growth / MIB:.0f} MiB "
            f"(budget {budget / MIB:.0f} MiB), after +{(after - baseline) / 1024:.1f} MiB"
        )
        assert peak_growth < budget + 32 * MIB
        assert (after - baseline) / 1024 < 24, "memory was not given back"
    assert "Traceback" not in server.output()


def test_held_bodies_cannot_starve_the_probes(digits_gallery, served_index) -> None:
    """510 connections send headers and hold their body back: probes and new requests
    still get JSON answers at once (503 for uploads past the slots), and every held body
    gets its 408 after the body timeout."""
    env = {**ENV, "VITRIEVAL_UPLOAD_SLOTS": "16", "VITRIEVAL_BODY_TIMEOUT_S": "2"}
    with Server(digits_gallery["model"], served_index, env=env) as server:
        held = []
        for _ in range(510):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(
                b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n"
            )
            held.append(sock)
        http = httpx.Client(base_url=server.url, timeout=5)
        started = time.perf_counter()
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert http.get(probe).status_code == 200, probe
        busy = http.post("/v1/search", json={"key": "1/digits_00001.png", "k": 1})
        probes_s = time.perf_counter() - started
        assert busy.status_code in (200, 503), busy.text
        answers = []
        for sock in held:
            answers.append(_read_answer(sock))
            sock.close()
        statuses = [a.split(" ", 2)[1] if a else "none" for a in answers]
        counts = {s: statuses.count(s) for s in set(statuses)}
        print(f"probes answered in {probes_s:.2f} s; held connections got {counts}")
        assert set(statuses) <= {"408", "503"}, counts
        assert statuses.count("408") >= 16  # the ones holding slots timed out
        assert all('"code":' in a for a in answers)  # every one a JSON error body
        after = http.post("/v1/search", json={"key": "1/digits_00001.png", "k": 1})
        assert after.status_code == 200  # slots are free again
    assert "Traceback" not in server.output()


def _read_answer(sock: socket.socket) -> str:
    sock.settimeout(10)
    answer = b""
    try:
        while b"}" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return answer.decode("latin-1")


def test_clients_that_hang_up_mid_upload_are_not_server_errors(server) -> None:
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/search HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: multipart/form-data; boundary=B\r\n"
                b"Content-Length: 100000\r\n\r\n--B\r\nContent-Disposition: form-data; "
                b'name="image"; filename="q.png"\r\n\r\n' + b"\x89PNG" * 100
            )
            time.sleep(0.2)
    time.sleep(0.5)
    metrics = httpx.get(f"{server.url}/metrics").text
    errors = [
        line
        for line in metrics.splitlines()
        if line.startswith("vitrieval_request_errors_total") and 'status="5' in line
    ]
    assert errors == [], errors
    assert 'vitrieval_client_disconnects_total{route="/v1/search"} 5.0' in metrics
    assert "Traceback" not in server.output()


def test_an_oversized_json_body_gets_its_413(server) -> None:
    """The client sends all 30 MB (as a plain HTTP client does) and then reads: it must
    find a 413 with its JSON body, not a connection reset."""
    body = b'{"k": 1, "vector": [' + b"0.5, " * (6 * MIB) + b"0.5]}"
    assert len(body) > 30 * 10**6
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        for start in range(0, len(body), MIB):
            sock.sendall(body[start : start + MIB])
        answer = _read_answer(sock)
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert '"code":"request_too_large"' in answer


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitrieval.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **(env or {})},
    )


def test_start_up_errors_are_one_line(digits_gallery, served_index, tmp_path) -> None:
    model = str(digits_gallery["model"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        result = _serve("--model", model, "--index", str(served_index), "--port", port, env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"vitrieval-serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    missing = _serve("--model", model, "--index", str(tmp_path / "nothing"), "--read-only")
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert not any("faiss" in line.lower() for line in lines), lines
    assert lines[-1].startswith("vitrieval-serve: cannot open index")


def test_an_altered_journal_stops_serve_and_info_with_one_line(
    digits_gallery, served_index
) -> None:
    server = Server(digits_gallery["model"], served_index, env=ENV).wait_ready()
    vector = [1.0] + [0.0] * 127
    http = httpx.Client(base_url=server.url, timeout=30)
    added = http.post("/v1/items", json={"key": "j/1", "vector": vector}, headers=AUTH)
    assert added.status_code == 201
    server.kill()  # no save: the add lives in the journal only
    with sqlite3.connect(served_index / JOURNAL_FILE) as db:
        seq, blob = db.execute("SELECT seq, vector FROM ops").fetchone()
        altered = np.frombuffer(blob, "<f4").copy()
        altered[1] = 0.5  # the attacker's vector
        db.execute("UPDATE ops SET vector = ? WHERE seq = ?", (altered.tobytes(), seq))
    port = str(free_port())
    args = ("--model", str(digits_gallery["model"]), "--index", str(served_index), "--port", port)
    result = _serve(*args, "--log-level", "warning", env=ENV)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"journal row {seq} fails its checksum" in lines[0], lines
    info = subprocess.run(
        [sys.executable, "-m", "vitrieval.index.cli", "info", str(served_index)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert info.returncode == 2
    info_lines = info.stderr.strip().splitlines()
    assert len(info_lines) == 1 and "fails its checksum" in info_lines[0], info_lines
