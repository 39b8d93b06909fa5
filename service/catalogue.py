"""The collections one server serves from a data folder (`vitrieval-serve --data DIR`).

Each collection is an index directory (index/collections.py says where) served as a
`ServiceState` of its own: its store, its upkeep (checkpoints, merges, scrub), its
duplicate jobs. What is costly to hold twice is shared: one `ServedModel` (ONNX
Runtime session and batcher) per model fingerprint, one decode pool and one decode
memory budget for the whole server.

- A collection opens on first use and is closed again once nobody has used it for
  `collection_idle_s` (its journal saved, its memory returned); the next request
  opens it again.
- A request resolves its collection once, when it starts (an alias to the collection
  it names then), and holds it until it ends: an alias switched meanwhile sends the
  next requests to the new collection while this one finishes where it started, and
  a collection is never closed under a request.
- A collection that cannot be opened (damaged, or of a model that fails its
  self-check) is reported by name in /v1/collections and /metrics; its own requests
  get 503 `collection_damaged`, the other collections serve on.
- Aliases are read from aliases.json, again whenever the file changed (the
  `vitrieval-index promote` command may switch one while the server runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vitrieval.index.collections import ALIASES_FILE, DataFolder
from vitrieval.index.gpu_notice import log_cpu_only
from vitrieval.index.store import StoreError
from vitrieval.index.store import manifest as mf

from .errors import ApiError, collection_error
from .maintenance import upkeep
from .memory import return_large_buffers_to_the_os
from .metrics import ServiceMetrics
from .reembed_jobs import ReembedJobs
from .settings import Settings
from .state import ServedModel, ServiceState, StartupError, decoding

logger = logging.getLogger("vitrieval.service")
T = TypeVar("T")

DEFAULT_ALIAS = "default"
"""What today's /v1/... routes address on a data folder server without --default."""
IDLE_CHECK_MAX_S = 30.0


@dataclass
class OpenCollection:
    """A collection being served: its state, the upkeep that closes it, its users."""

    name: str
    state: ServiceState
    closing: contextlib.AsyncExitStack
    in_use: int = 0
    last_used: float = field(default_factory=time.monotonic)


class Catalogue:
    """The collections of `folder` as this server serves them (module docstring)."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics, folder: DataFolder) -> None:
        self.settings = settings
        self.metrics = metrics
        self.folder = folder
        self.ready = False
        self.decode_pool, self.decode_budget = decoding(settings)
        self._open: dict[str, OpenCollection] = {}
        self._models: dict[str, ServedModel] = {}  # fingerprint -> the loaded model
        self._damaged: dict[str, str] = {}  # name -> why it cannot be opened (the log's words)
        self._opening: dict[str, asyncio.Lock] = {}
        self._aliases: tuple[Any, dict[str, str]] = (None, {})
        self._idle: asyncio.Task | None = None
        self.reembed_jobs = ReembedJobs()  # POST /v1/collections/{name}/reembed

    # -- names ---------------------------------------------------------------------------

    def aliases(self) -> dict[str, str]:
        """alias -> collection, re-read when aliases.json changed."""
        path = self.folder.root / ALIASES_FILE
        try:
            info = path.stat()
            stamp: Any = (info.st_mtime_ns, info.st_size, info.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp != self._aliases[0]:
            self._aliases = (stamp, self.folder.aliases() if stamp else {})
        return self._aliases[1]

    @property
    def default_name(self) -> str:
        return self.settings.default_collection or DEFAULT_ALIAS

    def resolve(self, name: str | None) -> str:
        """The collection `name` means (None: the default one), or a 404."""
        asked = self.default_name if name is None else name
        target = self.aliases().get(asked, asked)
        if target in self._open or self.folder.is_collection(target):
            return target
        if name is None:
            raise ApiError(
                404,
                "no_default_collection",
                f"the /v1/... routes serve the collection {asked!r}, which does not exist: "
                f"create it, or point the alias {DEFAULT_ALIAS!r} at a collection, or use "
                "/v1/collections/{name}/...",
            )
        raise ApiError(404, "unknown_collection", f"no collection or alias named {name!r}")

    # -- serving -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def using(self, name: str | None) -> AsyncIterator[ServiceState]:
        """The state of collection (or alias) `name`, opened if need be, held open for
        the block."""
        collection = self.resolve(name)
        opened = await self._get(collection)
        opened.in_use += 1
        try:
            yield opened.state
        finally:
            opened.in_use -= 1
            opened.last_used = time.monotonic()

    async def _get(self, name: str) -> OpenCollection:
        opened = self._open.get(name)
        if opened is not None:
            return opened
        lock = self._opening.setdefault(name, asyncio.Lock())
        async with lock:
            opened = self._open.get(name)
            if opened is None:
                opened = await self._load(name)
                self._open[name] = opened
        return opened

    async def _load(self, name: str) -> OpenCollection:
        try:
            model = await self._model_for(name)
            state = await asyncio.to_thread(
                ServiceState.serving,
                self.settings,
                self.metrics,
                model,
                self.folder.path(name),
                self.decode_pool,
                self.decode_budget,
                owns_decode_pool=False,
            )
        except (StartupError, StoreError, OSError) as exc:
            self._damaged[name] = str(exc)
            logger.error("collection %s cannot be served: %s", name, exc)
            raise ApiError(
                503,
                "collection_damaged",
                f"collection {name!r} cannot be opened; the server's log says why",
            ) from None
        self._damaged.pop(name, None)
        closing = contextlib.AsyncExitStack()
        await closing.enter_async_context(upkeep(state))
        state.ready = True
        logger.info("opened collection %s: %d items", name, len(state.store))
        return OpenCollection(name, state, closing)

    async def _model_for(self, name: str) -> ServedModel:
        """The loaded model of collection `name` (loaded from its model copy once per
        fingerprint)."""
        directory = self.folder.path(name)
        manifest = await asyncio.to_thread(mf.read_manifest, directory)
        entry = manifest.model
        if entry is None or entry.file is None or entry.fingerprint is None:
            raise StartupError(f"collection {name!r} keeps no model copy to embed queries with")
        model = self._models.get(entry.fingerprint)
        if model is None:
            path = directory / entry.file
            model = await asyncio.to_thread(ServedModel.load, self.settings, path, self.metrics)
            await model.batcher.start()
            log_cpu_only(model.cpu_only)
            self._models[entry.fingerprint] = model
        return model

    async def close(self, name: str, *, wait_s: float = 30.0) -> None:
        """Close collection `name` once its requests end (at most `wait_s`)."""
        opened = self._open.get(name)
        if opened is None:
            return
        deadline = time.monotonic() + wait_s
        while opened.in_use and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._open.get(name) is not opened:
            return  # closed by another caller meanwhile
        del self._open[name]
        opened.state.ready = False
        await opened.closing.aclose()
        await self._release_unused_models()
        logger.info("closed collection %s", name)

    async def _release_unused_models(self) -> None:
        used = {o.state.embedder.fingerprint for o in self._open.values()}
        for fingerprint in [f for f in self._models if f not in used]:
            await self._models.pop(fingerprint).batcher.stop()
        return_large_buffers_to_the_os()

    async def close_idle(self) -> list[str]:
        """Close the collections unused for `collection_idle_s`; their names."""
        now = time.monotonic()
        idle = [
            o.name
            for o in self._open.values()
            if not o.in_use
            and now - o.last_used >= self.settings.collection_idle_s
            and not o.state.duplicate_jobs.running
        ]
        for name in idle:
            await self.close(name, wait_s=0)
        return idle

    async def _close_idle_loop(self) -> None:
        every = min(IDLE_CHECK_MAX_S, max(0.05, self.settings.collection_idle_s / 4))
        while True:
            await asyncio.sleep(every)
            try:
                await self.close_idle()
            except Exception:  # the loop must outlive one failed close
                logger.exception("closing idle collections failed")

    async def start(self) -> None:
        self._idle = asyncio.create_task(self._close_idle_loop(), name="vitrieval-idle")
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        await self.reembed_jobs.stop()
        if self._idle is not None:
            self._idle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle
        for name in list(self._open):
            await self.close(name, wait_s=10.0)
        await self._release_unused_models()
        self.decode_pool.shutdown(wait=False, cancel_futures=True)

    # -- the collections and aliases -----------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        """What GET /v1/collections says of collection `name` (not opened for it)."""
        aliases = sorted(a for a, target in self.aliases().items() if target == name)
        entry: dict[str, Any] = {"name": name, "aliases": aliases, "open": name in self._open}
        opened = self._open.get(name)
        if name in self._damaged:
            return entry | {"status": "damaged", "count": None, "dim": None, "model": None}
        try:
            if opened is not None:
                store = opened.state.store
                count, dim = len(store), store.dim
                damaged = bool(store.damaged_segments())
                fingerprint = opened.state.embedder.fingerprint
            else:
                manifest = mf.read_manifest(self.folder.path(name))
                count, dim, damaged = manifest.count, manifest.dim, False
                fingerprint = manifest.model.fingerprint if manifest.model else None
        except (StoreError, OSError) as exc:
            logger.error("collection %s cannot be described: %s", name, exc)
            return entry | {"status": "damaged", "count": None, "dim": None, "model": None}
        status = "damaged" if damaged else "ok"
        return entry | {"status": status, "count": count, "dim": dim, "model": fingerprint}

    def listing(self, allowed: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Every collection (or those in `allowed`), described."""
        names = self.folder.names()
        return [self.describe(n) for n in names if allowed is None or n in allowed]

    def damaged(self) -> dict[str, int]:
        """collection -> damaged segments (-1: it cannot be opened), the damaged only."""
        found = {name: -1 for name in self._damaged}
        for name, opened in self._open.items():
            count = len(opened.state.store.damaged_segments())
            if count:
                found[name] = count
        return found

    def items(self) -> dict[str, int]:
        """collection -> live items, of the open collections."""
        return {name: len(o.state.store) for name, o in self._open.items()}

    async def create(
        self, name: str, *, model: str | None, snapshot: str | None, **options: Any
    ) -> dict[str, Any]:
        """A new collection from a model file under models/ or from a snapshot (its id
        in this folder, or a URL); answers its description."""
        if model is not None:
            await on_folder(self.folder.create, name, model, **options)
        else:
            assert snapshot is not None
            await on_folder(self.folder.restore, name, snapshot)
        self._damaged.pop(name, None)
        return self.describe(name)

    async def delete(self, name: str) -> None:
        """Close collection `name` and delete its folder (its snapshots are kept); the
        data folder refuses an alias's name and a collection an alias names."""
        await self.close(name)
        await on_folder(self.folder.delete, name)
        await self.close(name, wait_s=0)  # opened again by a request meanwhile
        self._damaged.pop(name, None)


async def on_folder(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, an operation on the data folder (files, locks), in a
    thread; its refusals answered as `collection_error` says."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except StoreError as exc:
        raise collection_error(exc) from None


def data_folder(path: Path | str | os.PathLike[str]) -> DataFolder:
    """The data folder at `path` (StartupError when there is none)."""
    try:
        return DataFolder(path)
    except StoreError as exc:
        raise StartupError(str(exc)) from None
