"""The sharded index directory: its names, its key-to-shard rule and its manifest.

This docstring is the contract of the format (`vitrieval-shards`, version 1)::

    INDEX/
      shards.json            the commit point (below); written last, atomically
      shard-000/ ...         shard i: an index directory as IndexStore writes it
                             (its own manifest, segments, journal, locks); shard 0
                             also keeps the index's one copy of the model
      build_report.json      the last build's report (every shard's in its folder)
      shards.build.json      while a sharded build runs: its plan (shard count,
                             factory, model fingerprint, embeddings folder, first item
                             id), which a re-run must match to resume it
      quantizer.build.faiss  while a sharded build runs: the quantizer it trained once

shards.json::

    {"format": "vitrieval-shards", "version": 1, "shards": ["shard-000", ...],
     "rule": "sha256-64-mod", "dim": D, "model_fingerprint": "<sha256>",
     "factory": "IVF64,Flat", "created": "<ISO 8601 UTC>"}

The key-to-shard rule: the first 8 bytes of the SHA-256 of the key's UTF-8 bytes, read
as a big-endian unsigned integer, modulo the number of shards. It is the same in every
process and Python version (Python's `hash()` of a string is salted per process).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..json_text import parse_json
from ..store import StoreError

SHARDS_FILE = "shards.json"
FORMAT = "vitrieval-shards"
VERSION = 1
RULE = "sha256-64-mod"
PLAN_FILE = "shards.build.json"
QUANTIZER_FILE = "quantizer.build.faiss"
SHARD_PREFIX = "shard-"


def shard_name(shard: int) -> str:
    """`shard-007`: the folder of shard `shard`."""
    return f"{SHARD_PREFIX}{shard:03d}"


def shard_of(key: str, shards: int) -> int:
    """The shard that owns `key` among `shards` (the rule in the module docstring)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def is_sharded(directory: str | Path) -> bool:
    """Whether `directory` holds a committed sharded index."""
    return (Path(directory) / SHARDS_FILE).is_file()


def store_directories(directory: str | Path) -> list[Path]:
    """The store folders of an index: its shards' for a sharded index, else itself."""
    directory = Path(directory)
    if not is_sharded(directory):
        return [directory]
    return [directory / name for name in read_shards_manifest(directory).shards]


@dataclass(frozen=True)
class ShardsManifest:
    """shards.json, parsed and checked."""

    shards: tuple[str, ...]
    dim: int
    fingerprint: str | None
    factory: str
    created: str

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "shards": list(self.shards),
            "rule": RULE,
            "dim": self.dim,
            "model_fingerprint": self.fingerprint,
            "factory": self.factory,
            "created": self.created,
        }


def write_shards_manifest(directory: Path, manifest: ShardsManifest) -> None:
    """Replace shards.json atomically: the commit point of a sharded build."""
    atomic_write_text(directory / SHARDS_FILE, json.dumps(manifest.to_json(), indent=2) + "\n")


def read_shards_manifest(directory: str | Path) -> ShardsManifest:
    """shards.json of `directory`; a StoreError naming the file and the problem."""
    path = Path(directory) / SHARDS_FILE
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{directory} is not a sharded index (no {SHARDS_FILE})") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StoreError(f"{path} is damaged: not readable JSON ({exc})") from None

    def field(name: str, kind: type | tuple[type, ...]) -> Any:
        value = data.get(name) if isinstance(data, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise StoreError(f"{path} is damaged: {name!r} is missing or not a {kind}")
        return value

    if field("format", str) != FORMAT or field("version", int) != VERSION:
        raise StoreError(
            f"{path}: format {data.get('format')!r} version {data.get('version')!r} is not "
            f"{FORMAT!r} version {VERSION} (an index of another vitrieval release?)"
        )
    if field("rule", str) != RULE:
        raise StoreError(f"{path}: unknown key-to-shard rule {data['rule']!r}, not {RULE!r}")
    shards = field("shards", list)
    expected = [shard_name(i) for i in range(len(shards))]
    if not shards or shards != expected:
        raise StoreError(f"{path} is damaged: 'shards' must be {expected or ['shard-000']}")
    dim = field("dim", int)
    if dim < 1:
        raise StoreError(f"{path} is damaged: 'dim' must be positive")
    fingerprint = data.get("model_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise StoreError(f"{path} is damaged: 'model_fingerprint' must be text")
    return ShardsManifest(
        shards=tuple(shards),
        dim=dim,
        fingerprint=fingerprint,
        factory=field("factory", str),
        created=str(data.get("created") or ""),
    )


def split_by_shard(keys: Sequence[str], shards: int) -> dict[int, list[int]]:
    """shard -> the positions in `keys` of the keys it owns (in their order)."""
    owned: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        owned.setdefault(shard_of(key, shards), []).append(position)
    return owned
