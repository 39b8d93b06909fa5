"""Hostile image files for the hardening tests: a decompression bomb and fuzzed copies
of real images."""

from __future__ import annotations

import random
import zlib


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid greyscale PNG of width x height black pixels: ~400 KB on the wire,
    400 MB once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    compressor = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte + pixels
    parts = [compressor.compress(row * 500) for _ in range(height // 500)]
    parts.append(compressor.flush())
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", b"".join(parts))
        + chunk(b"IEND", b"")
    )


def fuzzed(seed: int, originals: list[bytes]) -> bytes:
    rng = random.Random(seed)
    data = bytearray(rng.choice(originals))
    mode = rng.randrange(3)
    if mode in (0, 2):  # flip some bytes (often in the header: the first 64 bytes)
        for _ in range(rng.randint(1, 12)):
            span = 64 if rng.random() < 0.5 else len(data)
            data[rng.randrange(min(span, len(data)))] = rng.randrange(256)
    if mode in (1, 2):  # truncate
        data = data[: rng.randrange(1, len(data))]
    return bytes(data)
