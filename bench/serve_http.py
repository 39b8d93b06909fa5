"""The HTTP side of bench/serve_load.py: a `vitrieval-serve` process on loopback, a
lean keep-alive client that sends pre-encoded requests, and /metrics scraping.

Kept apart from the load generator so each file has one job; nothing here measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only
REQUEST_TIMEOUT_S = 30.0
BOUNDARY = "vitrievalbenchboundary7f3a"


def multipart_body(jpeg: bytes, k: int) -> bytes:
    """The form `files={"image": ...}, data={"k": k}` as bytes (boundary BOUNDARY)."""
    return (
        (
            f"--{BOUNDARY}\r\n"
            f'Content-Disposition: form-data; name="k"\r\n\r\n{k}\r\n'
            f"--{BOUNDARY}\r\n"
            f'Content-Disposition: form-data; name="image"; filename="query.jpg"\r\n'
            f"Content-Type: image/jpeg\r\n\r\n"
        ).encode()
        + jpeg
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def search_request(port: int, jpeg: bytes, k: int) -> bytes:
    body = multipart_body(jpeg, k)
    head = (
        f"POST /v1/search HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# -- the servers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class Server:
    """`python -m service.cli --model M --index DIR --read-only --[no-]batching` on loopback;
    `served` in place of `--model M --index DIR --read-only` (e.g. `--data DIR`, writable:
    the key comes in `env`)."""

    def __init__(
        self,
        mode: str,
        model: Path | None,
        index: Path | None,
        logs: Path,
        extra: list[str],
        env: dict,
        served: list[str] | None = None,
    ) -> None:
        self.mode = mode
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        if served is None:
            served = ["--model", str(model), "--index", str(index), "--read-only"]
        command = [
            sys.executable,
            "-m",
            "vitrieval.service.cli",
            *served,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--batching" if mode == "on" else "--no-batching",
            "--log-level",
            "warning",
            *extra,
        ]
        self.command = command
        self.log_path = logs / f"server-{mode}-{self.port}.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            # off: one model call at a time, the baseline, unless `env` says otherwise
            env={
                **os.environ,
                **({"VITRIEVAL_UNBATCHED_CONCURRENCY": "1"} if mode != "on" else {}),
                **env,
            },
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server ({self.mode}) exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server ({self.mode}) not ready after {timeout:g} s:\n{self.output()}")

    def info(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/v1/info", timeout=5) as response:
            return json.load(response)

    def cpu_seconds(self) -> float:
        """user + system CPU of the server process (all its threads) so far."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()


def machine_busy_seconds() -> float:
    """CPU seconds all processes have been busy (every core), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# -- the clients -------------------------------------------------------------------------


class RawConnection:
    """One HTTP/1.1 keep-alive connection sending pre-encoded requests (asyncio streams).

    Reads Content-Length and chunked bodies; reconnects after `Connection: close` or an
    error. Costs far less CPU per request than a general client, which matters when the
    clients share the server's cores."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, payload: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None
        reader, writer = self.reader, self.writer
        writer.write(payload)
        await writer.drain()
        line = await reader.readline()
        if not line:
            raise ConnectionError("the server closed the connection")
        status = int(line.split(b" ", 2)[1])
        length, chunked, close = None, False, False
        while True:
            header = await reader.readline()
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"connection":
                close = value == b"close"
        if chunked:
            parts = []
            while size := int((await reader.readline()).split(b";")[0], 16):
                parts.append(await reader.readexactly(size))
                await reader.readline()
            await reader.readline()
            body = b"".join(parts)
        elif length is not None:
            body = await reader.readexactly(length)
        else:
            body, close = await reader.read(), True
        if close:
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None


async def scrape_metrics(port: int) -> dict[str, float]:
    """GET /metrics -> {'name{labels}': value} (comments skipped)."""
    conn = RawConnection(port)
    try:
        request = f"GET /metrics HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
        status, body = await asyncio.wait_for(conn.request(request), REQUEST_TIMEOUT_S)
    finally:
        await conn.close()
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}")
    values = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)
