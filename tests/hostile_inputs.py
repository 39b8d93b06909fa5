"""A seeded generator of hostile requests for the service: images of every accepted
format and their damaged, oversized, oddly shaped, palette, 16-bit and multi-frame
variants, and JSON, multipart and urlencoded bodies carrying hostile text (lone
surrogates, NUL, control characters, 10 KB strings, deep nesting).

`hostile_requests(n, seed)` yields `HostileRequest`s; the same seed gives the same
requests, so a failure names an input that can be replayed.
"""

from __future__ import annotations

import base64
import io
import json
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hostile_images import fuzzed
from PIL import Image

DIM = 128
HOSTILE_TEXT = [
    "\ud800",
    "a\udfffb",
    "\x00",
    "nul\x00inside",
    "\x1b[31mred",
    "\x85next-line",
    "tab\there",
    "x" * 10_240,
    "😀" * 2000,
    "../../etc/passwd",
    "x/thumbnail",
    "",
    " ",
    "%ED%A0%80",
    "\u202eright-to-left",
    "\ufeffbom",
]

DOT_KEYS = [".", "..", "v/.", "hostile/..", "./x", "../x", "a/./b", "a//b", "hostile/", "//h"]
"""Keys HTTP clients would rewrite in a URL: refused at add with a 422."""
HUGE_INTEGERS = ["9223372036854775808", "-9223372036854775809", "1" + "0" * 400]
"""Integers int64 cannot hold, as JSON text: refused with a 422 wherever they appear."""
VECTOR_SCALES = [1e-22, 1e-30, 1e-300, 1e30, 1e38, 1e300]
"""Finite vectors whose squares leave float32's (or float64's) range: they normalise
and are served like any other."""


IMAGE_POOLS = 6
"""Sets of image variants drawn from (each a different photo, size and quality)."""


@dataclass
class HostileRequest:
    """What to send: `method` `path` with `json_text` (sent verbatim), or multipart
    `files` + `data`, or raw `content` with `content_type`."""

    name: str
    method: str = "POST"
    path: str = "/v1/search"
    json_text: str | None = None
    files: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    content: bytes | None = None
    content_type: str | None = None
    auth: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    expect: tuple[int, ...] = ()
    """The statuses the request must get (empty: any below 500)."""


def _photo(rng: random.Random, size: int) -> Image.Image:
    from skimage import data

    photos = (data.astronaut, data.coffee, data.chelsea, data.rocket)
    image = Image.fromarray(rng.choice(photos)())
    return image.resize((size, max(8, int(size * rng.uniform(0.5, 2.0)))))


def _encode(image: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def image_variants(rng: random.Random) -> list[tuple[str, bytes]]:
    """One of each kind of image: every accepted format, palette, alpha, 16-bit,
    multi-frame, and headers announcing extreme dimensions or aspect ratios."""
    photo = _photo(rng, rng.choice((24, 48, 96)))
    grey16 = Image.fromarray((np.asarray(photo.convert("L"), np.uint16) * 257).astype(np.uint16))
    frames = [photo.rotate(angle) for angle in (0, 90, 180)]
    variants = [
        ("jpeg", _encode(photo, "JPEG", quality=rng.randint(5, 95))),
        ("png", _encode(photo, "PNG")),
        ("webp", _encode(photo, "WEBP")),
        ("bmp", _encode(photo, "BMP")),
        ("gif", _encode(photo.convert("P"), "GIF")),
        ("tiff", _encode(photo, "TIFF")),
        ("png-palette-alpha", _encode(photo.convert("P"), "PNG", transparency=0)),
        ("png-rgba", _encode(photo.convert("RGBA"), "PNG")),
        ("png-16bit-grey", _encode(grey16, "PNG")),
        ("png-la", _encode(photo.convert("LA"), "PNG")),
        ("jpeg-cmyk", _encode(photo.convert("CMYK"), "JPEG")),
        ("gif-animated", _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])),
        ("tiff-multipage", _encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])),
        ("png-animated", _encode(frames[0], "PNG", save_all=True, append_images=frames[1:])),
        ("webp-animated", _encode(frames[0], "WEBP", save_all=True, append_images=frames[1:])),
        ("png-header-huge", _png_header(rng.choice((70_000, 100_000)), 70_000)),
        ("png-header-strip", _png_header(rng.choice((1, 2)), rng.choice((300_000, 39_000_000)))),
        ("png-header-zero", _png_header(0, 10)),
        ("ppm-not-allowed", _encode(photo, "PPM")),
        ("empty", b""),
        ("text", b"GIF89a? no, just text " * rng.randint(1, 50)),
    ]
    return variants


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header announces width x height but whose data is a few bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    data = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def _damaged(rng: random.Random, originals: list[bytes]) -> bytes:
    return fuzzed(rng.randrange(2**31), originals)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _json_bodies(rng: random.Random) -> list[tuple[str, str, str, bool, tuple[int, ...]]]:
    """(name, path, JSON text, needs auth, the statuses it must get) with hostile text in
    every string field, keys clients would rewrite, vectors of extreme scale and
    integers outside int64 in metadata and filters."""
    text = rng.choice(HOSTILE_TEXT)
    quoted = json.dumps(text)  # lone surrogates stay \\udXXX escapes, as an attacker sends
    vector = json.dumps([rng.uniform(-1, 1) for _ in range(DIM)])
    scale = rng.choice(VECTOR_SCALES)
    scaled = json.dumps([rng.uniform(-1, 1) * scale for _ in range(DIM)])
    dot_key = json.dumps(rng.choice(DOT_KEYS))
    huge = rng.choice(HUGE_INTEGERS)
    huge_filter = rng.choice(
        [
            '{"must": [{"key": "n", "match": ' + huge + "}]}",
            '{"must": [{"key": "n", "match": {"any": [1, ' + huge + "]}}]}",
            '{"must_not": [{"key": "n", "range": {"gte": ' + huge + "}}]}",
        ]
    )
    metadata = rng.choice(
        [
            "{" + quoted + ": 1}",
            '{"note": ' + quoted + "}",
            '{"a": ' + _deep(rng.choice((20, 10_000))) + "}",
            '{"n": 1e999}',
            '{"list": [' + ",".join([quoted] * 50) + "]}",
        ]
    )
    bodies = [
        ("search-key", "/v1/search", '{"key": ' + quoted + ', "k": 3}', False),
        (
            "search-label",
            "/v1/search",
            '{"vector": ' + vector + ', "label": ' + quoted + "}",
            False,
        ),
        ("search-b64", "/v1/search", '{"image_base64": ' + quoted + "}", False),
        ("search-field", "/v1/search", "{" + quoted + ': 1, "vector": ' + vector + "}", False),
        ("search-deep", "/v1/search", '{"vector": ' + _deep(rng.choice((50, 50_000))) + "}", False),
        ("search-k", "/v1/search", '{"vector": ' + vector + ', "k": ' + quoted + "}", False),
        (
            "item-key",
            "/v1/items",
            '{"key": ' + quoted + ', "vector": ' + vector + ', "replace": true}',
            True,
        ),
        (
            "item-label",
            "/v1/items",
            '{"key": "hostile/1", "label": ' + quoted + ', "vector": ' + vector + "}",
            True,
        ),
        (
            "item-metadata",
            "/v1/items",
            '{"key": "hostile/2", "metadata": ' + metadata + ', "vector": ' + vector + "}",
            True,
        ),
        (
            "evaluate-label",
            "/v1/evaluate",
            '{"mode": "queries", "queries": [{"label": ' + quoted + ', "vector": ' + vector + "}]}",
            False,
        ),
        ("embed-b64", "/v1/embed", '{"image_base64": ' + quoted + "}", False),
        ("not-json", "/v1/search", '{"key": ' + quoted[:-1], False),
    ]
    checked = [
        (
            "item-dot-key",
            "/v1/items",
            '{"key": ' + dot_key + ', "vector": ' + vector + ', "replace": true}',
            True,
            (422,),
        ),
        (f"search-vector-{scale:g}", "/v1/search", '{"vector": ' + scaled + "}", False, (200,)),
        (
            "item-huge-integer",
            "/v1/items",
            '{"key": "hostile/huge", "metadata": {"n": [1, '
            + huge
            + ']}, "vector": '
            + vector
            + "}",
            True,
            (422,),
        ),
        (
            "search-huge-integer",
            "/v1/search",
            '{"vector": ' + vector + ', "filter": ' + huge_filter + "}",
            False,
            (422,),
        ),
        ("evaluate-huge-integer", "/v1/evaluate", '{"filter": ' + huge_filter + "}", False, (422,)),
        (
            f"item-vector-{scale:g}",
            "/v1/items",
            '{"key": "hostile/scaled", "vector": ' + scaled + ', "replace": true}',
            True,
            (201,),
        ),
    ]
    return [(*body, ()) for body in bodies] + checked


def hostile_requests(n: int, seed: int = 0) -> Iterator[HostileRequest]:
    """`n` requests drawn from images (as multipart uploads and as base64 in JSON),
    hostile JSON, multipart and urlencoded bodies, paths and query strings."""
    rng = random.Random(seed)
    pools = [image_variants(random.Random(seed * 1000 + j)) for j in range(IMAGE_POOLS)]
    originals = [data for _, data in pools[0][:6]]
    for i in range(n):
        kind = rng.random()
        if kind < 0.45:  # an image: a variant, or a damaged copy of one
            name, data = rng.choice(rng.choice(pools))
            if rng.random() < 0.4 and data:
                name, data = f"{name}-damaged", _damaged(rng, [data, *originals])
            path = rng.choice(("/v1/search", "/v1/embed", "/v1/items"))
            fields = {"k": "3"} if path == "/v1/search" else {}
            expect: tuple[int, ...] = ()
            if path == "/v1/items":
                fields = {"key": f"hostile/img/{i}", "label": "h", "replace": "true"}
                if rng.random() < 0.15:  # the key is checked before the image is read
                    fields["key"], expect = rng.choice(DOT_KEYS), (422,)
            if rng.random() < 0.25:  # the same image as base64 in JSON
                body = {"image_base64": base64.b64encode(data).decode(), **fields}
                body.pop("replace", None)
                if path == "/v1/search":
                    body["k"] = 3
                yield HostileRequest(
                    f"{i}:{name}:json",
                    path=path,
                    json_text=json.dumps(body),
                    auth=path == "/v1/items",
                    expect=expect,
                )
            else:
                yield HostileRequest(
                    f"{i}:{name}",
                    path=path,
                    files={"image": (f"{name}.bin", data, "application/octet-stream")},
                    data=fields,
                    auth=path == "/v1/items",
                    expect=expect,
                )
        elif kind < 0.7:
            name, path, text, auth, expect = rng.choice(_json_bodies(rng))
            yield HostileRequest(f"{i}:{name}", path=path, json_text=text, auth=auth, expect=expect)
        elif kind < 0.82:  # multipart text fields
            text = rng.choice([t for t in HOSTILE_TEXT if "\ud800" not in t and "\udfff" not in t])
            field_name = rng.choice(("key", "label", "k", "metadata", text[:20] or "x"))
            yield HostileRequest(
                f"{i}:multipart-{field_name[:10]!r}",
                path=rng.choice(("/v1/search", "/v1/items")),
                files={"unused" if rng.random() < 0.3 else "image": (None, text)},
                data={field_name: text, "k": "2"},
                auth=True,
            )
        elif kind < 0.92:  # urlencoded bodies with raw hostile bytes
            raw = rng.choice(
                [
                    b"key=%ED%A0%80&k=3",
                    b"key=%00&k=3",
                    b"label=%FF%FE%FD&vector=1",
                    b"k=" + b"9" * 5000,
                    b"key=" + b"%41" * 4000,
                    b"&&&==&=&",
                    bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))),
                ]
            )
            yield HostileRequest(
                f"{i}:urlencoded",
                content=raw,
                content_type="application/x-www-form-urlencoded",
            )
        else:  # paths and query strings
            target = rng.choice(
                [
                    "/v1/items/%ED%A0%80",
                    "/v1/items/a%00b",
                    "/v1/items/" + "%41" * 3000,
                    "/v1/items/x/thumbnail?size=%FF",
                    "/v1/items/1/digits_00001.png?vector=%ED%A0%80",
                    "/v1/items/1/digits_00001.png/thumbnail?size=99999",
                    "/v1/items/..%2F..%2Fetc%2Fpasswd",
                    "/v1/search?k=%00",
                ]
            )
            method = rng.choice(("GET", "DELETE"))
            yield HostileRequest(f"{i}:url", method=method, path=target, auth=True)
