"""Real `vitrieval-serve` processes for the client's tests (tests/test_client*.py):
what each server is started with, and small inputs that provoke its errors."""

from __future__ import annotations

import io
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from PIL import Image
from serving import Server

KEY = "client-write-key-0123"
READ_KEY = "client-read-key-0123"
SMALL_BODY = 2048
"""The limited server's --max-body-bytes."""
SMALL_PIXELS = 64 * 64
"""The limited server's VITRIEVAL_MAX_PIXELS (the digits are 32 x 32)."""


def served_copy(digits_gallery: dict[str, Path], folder: Path) -> Path:
    """A private copy of the digits gallery's index in `folder`."""
    return Path(shutil.copytree(digits_gallery["index"], folder / "index"))


def main_server(digits_gallery: dict[str, Path], folder: Path) -> Server:
    """Writable, a write key and a read key: every route works with the right key."""
    env = {"VITRIEVAL_API_KEY": KEY, "VITRIEVAL_READ_API_KEY": READ_KEY}
    return Server(digits_gallery["model"], served_copy(digits_gallery, folder), env=env)


def limited_server(digits_gallery: dict[str, Path], folder: Path) -> Server:
    """Read-only, one request at a time, small bodies and images: the server that
    answers 403, 413 and 503."""
    env = {"VITRIEVAL_MAX_CONCURRENCY": "1", "VITRIEVAL_MAX_PIXELS": str(SMALL_PIXELS)}
    index = served_copy(digits_gallery, folder)
    args = ("--read-only", "--max-body-bytes", str(SMALL_BODY))
    return Server(digits_gallery["model"], index, *args, env=env)


def png(width: int, height: int, colour: int = 128) -> bytes:
    """A plain grey PNG (a few hundred bytes whatever its size)."""
    buffer = io.BytesIO()
    Image.new("L", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@contextmanager
def slot_held(url: str) -> Iterator[None]:
    """A request whose body never finishes arriving: on a server that takes one
    request at a time, every other request meanwhile is refused with 503.

    The server counts a request out a moment after its answer is sent, so the held
    request may itself be refused just after another call: then it is sent again."""
    host, port = url.removeprefix("http://").split(":")
    for _ in range(50):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            sock.settimeout(0.2)
            try:
                sock.recv(1)  # answered at once: the slot was not free yet
            except TimeoutError:  # no answer: the server is waiting for the body
                yield
                return
    raise AssertionError("the server answered every request meant to hold its slot")
