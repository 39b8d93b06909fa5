"""Keys per collection: the keys file of `vitrieval-serve --data DIR --keys FILE`.

    {"KEY": {"collections": ["shop", "staging"] | "*", "write": true | false}, ...}

Each key reads the collections it lists (or all, "*") and, with `write`, adds and
deletes items in them. It never reaches a collection it is not given, nor creates or
deletes collections and aliases: that is the server's admin key (VITRIEVAL_API_KEY).
Keys are held to the admin key's rules (`settings.api_key_problem`), and a key is found
by comparing the one given with every key of the file in constant time, with no early
exit, so the time of an answer says nothing about which keys exist.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitrieval.index.collections import check_name
from vitrieval.index.json_text import parse_json

from .settings import api_key_problem

ALL = "*"


class KeysFileError(ValueError):
    """A keys file that cannot be used, and why (the keys themselves never quoted)."""


@dataclass(frozen=True)
class Rights:
    """What one key may do: read `collections` (None: every one), write with `write`."""

    collections: frozenset[str] | None
    write: bool

    def allows(self, collection: str, *, write: bool = False) -> bool:
        if write and not self.write:
            return False
        return self.collections is None or collection in self.collections


class KeyRing:
    """The keys of a keys file and their rights."""

    def __init__(self, keys: Mapping[str, Rights]) -> None:
        self._keys = [(key.encode(), rights) for key, rights in keys.items()]

    def __len__(self) -> int:
        return len(self._keys)

    def rights(self, given: str | None) -> Rights | None:
        """The rights of the key `given` (None: no such key)."""
        if given is None:
            return None
        probe = given.encode()
        found = None
        for key, rights in self._keys:  # every key compared: constant time
            if secrets.compare_digest(probe, key):
                found = rights
        return found

    @classmethod
    def from_json(cls, raw: Any, where: str = "the keys file") -> KeyRing:
        if not isinstance(raw, dict):
            raise KeysFileError(f"{where} must be a JSON object of key -> rights")
        keys = {}
        for n, (key, entry) in enumerate(raw.items(), 1):
            problem = api_key_problem(key) if isinstance(key, str) else "is not a string"
            if problem:
                raise KeysFileError(f"{where}: key number {n} {problem}")
            keys[key] = _rights(entry, f"{where}: key number {n}")
        return cls(keys)

    @classmethod
    def read(cls, path: Path) -> KeyRing:
        try:
            raw = parse_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KeysFileError(f"keys file not found: {path}") from None
        except (OSError, ValueError) as exc:
            raise KeysFileError(f"cannot read keys file {path}: {exc}") from None
        return cls.from_json(raw, str(path))


def _rights(entry: Any, where: str) -> Rights:
    if not isinstance(entry, dict) or set(entry) - {"collections", "write"}:
        raise KeysFileError(f'{where} must map to {{"collections": [...] | "*", "write": bool}}')
    collections = entry.get("collections")
    write = entry.get("write", False)
    if not isinstance(write, bool):
        raise KeysFileError(f"{where}: write must be true or false")
    if collections == ALL:
        return Rights(None, write)
    if not isinstance(collections, list) or not collections:
        raise KeysFileError(f'{where}: collections must be a non-empty list of names, or "*"')
    try:
        names = frozenset(check_name(name) for name in collections)
    except Exception as exc:  # StoreError: a name that no collection can have
        raise KeysFileError(f"{where}: {exc}") from None
    return Rights(names, write)
