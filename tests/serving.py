"""A real `vitrieval-serve` process on loopback for the tests that need one (crash
recovery, schema fuzzing, the browser): started with the CLI, waited for on /readyz,
stopped (or SIGKILLed) by the test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`vitrieval-serve --model M --index DIR --host 127.0.0.1 --port P [args]`, or with
    `data`, `vitrieval-serve --data DIR ...` (model and index None)."""

    def __init__(
        self,
        model: Path | None,
        index: Path | None,
        *args: str,
        env: dict[str, str] | None = None,
        data: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        served = ["--data", str(data)] if data else ["--model", str(model), "--index", str(index)]
        folder = data if data else index
        assert folder is not None
        command = [
            sys.executable,
            "-m",
            "vitrieval.service.cli",
            *served,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        self.log = open(folder.parent / f"server-{self.port}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}: {self.output()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s: {self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text()

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        return self.process.returncode

    def __enter__(self) -> Server:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
