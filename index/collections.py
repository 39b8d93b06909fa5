"""A data folder of named collections and aliases: what `vitrieval-serve --data DIR`
serves.

Layout (one place; everything else asks this module)::

    DIR/models/FILE.onnx          model files collections are created from
    DIR/collections/NAME/         one index directory per collection (its own model copy)
    DIR/aliases.json              {"aliases": {"ALIAS": "NAME", ...}}
    DIR/snapshots/NAME/ID.tar     snapshots of collection NAME (index/collection_snapshots.py)
    DIR/snapshots/.deleted-NAME-X/  those of a deleted collection NAME, kept, not served
    DIR/collections/.building-NAME/  a collection being built (a re-embedding), not served

Names (collections and aliases alike) match NAME_PATTERN and share one namespace: an
alias may not take a collection's name, nor a collection an alias's. An index folder
moved under `collections/` is a collection. An alias names an existing collection;
a collection an alias names cannot be deleted (repoint or delete the alias first), so
no alias ever points nowhere.

aliases.json is replaced atomically (written beside, fsynced, renamed) under an
exclusive lock on DIR/.aliases.lock, so concurrent writers in several processes
serialise, and a crash leaves either the old file or the new one (and a temporary
file, which the next writer removes). A collection is
deleted by renaming its folder out of `collections/` first (atomic: it is gone or
whole), then removing the renamed folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from .atomic import atomic_write_text, fsync_dir
from .json_text import parse_json
from .shards.store import is_index
from .store import IndexStore, StoreError

MODELS_DIR = "models"
COLLECTIONS_DIR = "collections"
ALIASES_FILE = "aliases.json"
SNAPSHOTS_DIR = "snapshots"
SNAPSHOT_ID = re.compile(r"[0-9]{8}t[0-9]{6}z-[0-9a-f]{8}")
"""Snapshot ids: the UTC time taken and 8 random hex digits (`new_snapshot_id`)."""
_ALIASES_LOCK = ".aliases.lock"
_TRASH_PREFIX = ".deleting-"
_BUILDING_PREFIX = ".building-"
_DELETED_PREFIX = ".deleted-"
DEFAULT_FACTORY = "Flat"
"""A new collection's FAISS factory: exact search, trained on nothing (it starts empty)."""
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""Collection and alias names: lower-case letters, digits, '_' and '-', 1 to 64."""
NAME_REGEX = f"^{NAME_PATTERN.pattern}$"
"""NAME_PATTERN anchored, as OpenAPI and pydantic state a pattern."""


class UnknownCollection(StoreError):
    """No collection or alias of that name (an HTTP 404)."""


class NameTaken(StoreError):
    """The name is a collection or an alias already, or the collection is in use by an
    alias (an HTTP 409)."""


def check_name(name: str, what: str = "collection") -> str:
    """`name` when it is a valid collection or alias name; else a StoreError."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise StoreError(
            f"{what} name {name!r} is not valid: 1 to 64 of a-z, 0-9, '_' and '-', "
            "starting with a letter or digit"
        )
    return name


class DataFolder:
    """The collections, models and aliases of one data folder (module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise StoreError(f"data folder not found: {self.root}")
        for sub in (MODELS_DIR, COLLECTIONS_DIR):
            (self.root / sub).mkdir(exist_ok=True)

    # -- collections ---------------------------------------------------------------------

    def names(self) -> list[str]:
        """The collections, sorted: the index folders under collections/ with valid names."""
        folder = self.root / COLLECTIONS_DIR
        return sorted(p.name for p in folder.iterdir() if self.is_collection(p.name))

    def is_collection(self, name: str) -> bool:
        """Whether `name` is a collection (not an alias): one stat, no listing."""
        return bool(NAME_PATTERN.fullmatch(name)) and is_index(self.directory(name))

    def resolve(self, name: str) -> str:
        """The collection `name` means: itself, or the one the alias names."""
        check_name(name)
        target = self.aliases().get(name, name)
        if not self.is_collection(target):
            raise UnknownCollection(f"no collection or alias named {name!r}")
        return target

    def path(self, name: str) -> Path:
        """The index folder of collection (or alias) `name`."""
        return self.directory(self.resolve(name))

    def directory(self, collection: str) -> Path:
        """The index folder of `collection`, a collection's own name (no alias read)."""
        return self.root / COLLECTIONS_DIR / collection

    def model_file(self, file: str) -> Path:
        """A model file under models/ (a plain file name: no folders, no '..')."""
        path = self.root / MODELS_DIR / file
        if Path(file).name != file or file.startswith(".") or not path.is_file():
            known = sorted(p.name for p in (self.root / MODELS_DIR).glob("*.onnx"))
            raise StoreError(
                f"no model file {file!r} under the data folder's {MODELS_DIR}/ "
                f"(there: {', '.join(known) or 'none'})"
            )
        return path

    def create(
        self,
        name: str,
        model: str,
        *,
        factory: str = DEFAULT_FACTORY,
        filter_fields: Sequence[str] | None = None,
    ) -> Path:
        """A new empty collection embedded by the model file `model` (under models/);
        NameTaken when the name is a collection or an alias."""
        from .runtime.model_metadata import read_model_metadata

        check_name(name)
        model_path = self.model_file(model)
        meta = read_model_metadata(model_path)
        with self._aliases_locked() as aliases:
            self._check_free(name, aliases)
            path = self.directory(name)
            store = IndexStore.create(
                path,
                dim=meta.embedding_dim,
                factory=factory,
                fingerprint=meta.fingerprint,
                model_path=model_path,
                filter_fields=filter_fields,
            )
            store.save()
            store.close()
        return path

    def restore(self, name: str, snapshot: str) -> Path:
        """A new collection `name` holding the items of `snapshot`: a snapshot id of this
        folder, or a URL (remote_files.py); a failed restore leaves nothing
        (restore_snapshot). NameTaken as `create`."""
        from .remote_files import is_url, reading
        from .store.snapshot import restore_snapshot

        source = snapshot if is_url(snapshot) else str(self.snapshot_file(snapshot))
        # restored beside, outside the lock (a download takes its time), then renamed in
        built = self.building(name).with_name(f"{_TRASH_PREFIX}restore-{uuid.uuid4().hex[:8]}")
        try:
            with reading(source) as stream:
                restore_snapshot(stream, built)
            return self.adopt(name, built)
        finally:
            shutil.rmtree(built, ignore_errors=True)  # gone once adopted; else a leftover

    def building(self, name: str) -> Path:
        """Where collection `name` is built before it is served (`adopt`); NameTaken
        when the name is a collection or an alias already."""
        self._check_free(check_name(name), self.aliases())
        return self.root / COLLECTIONS_DIR / f"{_BUILDING_PREFIX}{name}"

    def _check_free(self, name: str, aliases: dict[str, str]) -> None:
        if name in aliases or self.is_collection(name):
            raise NameTaken(f"{name!r} is already a collection or an alias")

    def adopt(self, name: str, built: Path | None = None) -> Path:
        """Serve the collection built in `built` (default `building(name)`): renamed
        into place at once (NameTaken when the name was taken meanwhile)."""
        with self._aliases_locked() as aliases:
            self._check_free(name, aliases)
            folder = self.root / COLLECTIONS_DIR
            os.rename(built or folder / f"{_BUILDING_PREFIX}{name}", folder / name)
            fsync_dir(folder)
        return folder / name

    # -- snapshots -----------------------------------------------------------------------

    def snapshot_folder(self, collection: str) -> Path:
        """Where collection `collection`'s snapshots are kept (made on first use)."""
        folder = self.root / SNAPSHOTS_DIR / check_name(collection)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def snapshot_file(self, snapshot: str, collection: str | None = None) -> Path:
        """The tar file of snapshot `snapshot` (of `collection`, or of any collection:
        ids are unique); UnknownCollection when there is none."""
        if SNAPSHOT_ID.fullmatch(snapshot):
            folders = [collection] if collection else self._snapshot_owners()
            for owner in folders:
                path = self.root / SNAPSHOTS_DIR / owner / f"{snapshot}.tar"
                if path.is_file():
                    return path
        raise UnknownCollection(f"no snapshot {snapshot!r}")

    def _snapshot_owners(self) -> list[str]:
        folder = self.root / SNAPSHOTS_DIR
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if NAME_PATTERN.fullmatch(p.name))

    def check_deletable(self, name: str, aliases: dict[str, str] | None = None) -> None:
        """UnknownCollection, or NameTaken while `name` is an alias or an alias names it."""
        check_name(name)
        aliases = self.aliases() if aliases is None else aliases
        if name in aliases:
            raise NameTaken(f"{name!r} is an alias: delete it with the alias routes")
        if not self.is_collection(name):
            raise UnknownCollection(f"no collection named {name!r}")
        users = sorted(a for a, target in aliases.items() if target == name)
        if users:
            raise NameTaken(
                f"collection {name!r} is named by alias {', '.join(users)}: repoint or "
                "delete the alias first"
            )

    def delete(self, name: str) -> None:
        """Delete collection `name` (not an alias); NameTaken while an alias names it.
        Its snapshots are kept, moved aside out of any later collection's reach
        (snapshots/.deleted-NAME-XXXXXXXX/)."""
        with self._aliases_locked() as aliases:
            self.check_deletable(name, aliases)
            folder = self.root / COLLECTIONS_DIR
            tag = f"{name}-{uuid.uuid4().hex[:8]}"
            trash = folder / f"{_TRASH_PREFIX}{tag}"
            os.rename(folder / name, trash)  # gone at once, whatever the removal takes
            fsync_dir(folder)
            snapshots = self.root / SNAPSHOTS_DIR / name
            if snapshots.is_dir():  # a new collection of this name must not read them
                os.rename(snapshots, snapshots.parent / f"{_DELETED_PREFIX}{tag}")
                fsync_dir(snapshots.parent)
        shutil.rmtree(trash, ignore_errors=True)

    # -- aliases -------------------------------------------------------------------------

    def aliases(self) -> dict[str, str]:
        """alias -> collection, as aliases.json holds them now."""
        return _read_aliases(self.root / ALIASES_FILE)

    def set_alias(self, alias: str, collection: str, *, expected: str | None = None) -> str | None:
        """Point `alias` at `collection` (atomically); returns the collection it named
        before (None: a new alias). With `expected`, only if the alias still names that
        collection (a compare-and-set: NameTaken when another switch came first)."""
        check_name(alias, "alias")
        check_name(collection)
        with self._aliases_locked() as aliases:
            if self.is_collection(alias):
                raise NameTaken(f"{alias!r} is a collection: an alias needs a name of its own")
            if not self.is_collection(collection):
                raise UnknownCollection(f"no collection named {collection!r}")
            before = aliases.get(alias)
            if expected is not None and before != expected:
                raise NameTaken(
                    f"alias {alias!r} names {before!r} now, not {expected!r}: it was switched "
                    "meanwhile"
                )
            self._write_aliases({**aliases, alias: collection})
        return before

    def delete_alias(self, alias: str) -> str:
        """Remove `alias`; returns the collection it named."""
        check_name(alias, "alias")
        with self._aliases_locked() as aliases:
            if alias not in aliases:
                raise UnknownCollection(f"no alias named {alias!r}")
            target = aliases.pop(alias)
            self._write_aliases(aliases)
        return target

    @contextlib.contextmanager
    def _aliases_locked(self) -> Iterator[dict[str, str]]:
        fd = os.open(self.root / _ALIASES_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # a writer killed mid-write left its temporary file: no writer is writing now
            for stale in self.root.glob(f".{ALIASES_FILE}.*.tmp"):
                stale.unlink(missing_ok=True)
            yield self.aliases()
        finally:
            os.close(fd)  # releases the lock

    def _write_aliases(self, aliases: dict[str, str]) -> None:
        text = json.dumps({"aliases": dict(sorted(aliases.items()))}, indent=2) + "\n"
        atomic_write_text(self.root / ALIASES_FILE, text)


def _read_aliases(path: Path) -> dict[str, str]:
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read {path}: {exc}") from None
    aliases = data.get("aliases") if isinstance(data, dict) else None
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise StoreError(f"{path} is not an aliases file ({{'aliases': {{...}}}})")
    return dict(aliases)


def new_snapshot_id() -> str:
    """A new snapshot id (SNAPSHOT_ID): sortable by time, unique by its random part."""
    return f"{time.strftime('%Y%m%dt%H%M%Sz', time.gmtime())}-{uuid.uuid4().hex[:8]}"
