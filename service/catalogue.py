"""The collections one server serves from a data folder (`vitrieval-serve --data DIR`).

Each collection is an index directory (index/collections.py says where) served as a
`ServiceState` of its own: its store, its upkeep (checkpoints, merges, scrub), its
duplicate jobs. What is costly to hold twice is shared: one `ServedModel` (ONNX
Runtime session and batcher) per model fingerprint, one decode pool and one decode
memory budget for the whole server.

- A collection opens on first use and is closed again once nobody has used it for
  `collection_idle_s` (its journal saved, its memory returned); the next request
  opens it again. Opening and closing a name hold its lock (never both at once), and
  run as the catalogue's own tasks: a request that gives up (its timeout) does not
  cut an open or a close short, which would leave a store holding its journal lock.
- A collection is closed only when no request holds it (a shutdown excepted); while it
  closes or is deleted, its requests get 503 `collection_busy`.
- A request resolves its collection once, when it starts (an alias to the collection
  it names then), and holds it until it ends: an alias switched meanwhile sends the
  next requests to the new collection while this one finishes where it started, and
  a collection is never closed under a request.
- A collection that cannot be opened (damaged, or of a model that fails its
  self-check) is reported by name in /v1/collections and /metrics; its own requests
  get 503 `collection_damaged` (tried again after DAMAGED_RETRY_S), the other
  collections serve on.
- Models are counted: the last open collection of a model unloads it.
- Aliases are read from aliases.json, again whenever the file changed (the
  `vitrieval-index promote` command may switch one while the server runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vitrieval.index.collections import ALIASES_FILE, DataFolder
from vitrieval.index.gpu_notice import log_cpu_only
from vitrieval.index.store import StoreError
from vitrieval.index.store import manifest as mf

from .errors import ApiError, collection_error, storage_error
from .maintenance import maintained
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
DAMAGED_RETRY_S = 30.0
"""A collection that failed to open is tried again after this long, not per request."""


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
        self._model_users: Counter[str] = Counter()  # fingerprint -> open collections
        self._models_lock = asyncio.Lock()
        # name -> (why it cannot be opened, in the log's words; when that was found)
        self._damaged: dict[str, float] = {}  # name -> when it failed to open
        self._locks: dict[str, asyncio.Lock] = {}
        self._loads: dict[str, asyncio.Task] = {}
        self._closing: set[str] = set()
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
            try:
                self._aliases = (stamp, self.folder.aliases() if stamp else {})
            except StoreError as exc:  # serve on with the aliases read last
                logger.error("aliases not read again, the last ones kept: %s", exc)
                self._aliases = (stamp, self._aliases[1])
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
    async def using(self, collection: str) -> AsyncIterator[ServiceState]:
        """The state of `collection` (a resolved name), opened if need be, held open for
        the block: it is not closed before the block ends."""
        opened = await self._get(collection)
        opened.in_use += 1
        try:
            yield opened.state
        finally:
            opened.in_use -= 1
            opened.last_used = time.monotonic()

    async def _get(self, name: str) -> OpenCollection:
        if name in self._closing:
            raise ApiError(
                503,
                "collection_busy",
                f"collection {name!r} is being closed or deleted; retry shortly",
                {"Retry-After": "1"},
            )
        opened = self._open.get(name)
        if opened is not None:
            return opened
        failed_at = self._damaged.get(name)
        if failed_at is not None and time.monotonic() - failed_at < DAMAGED_RETRY_S:
            raise _damaged_error(name)
        load = self._loads.get(name)
        if load is None:  # the catalogue's task: a request that gives up does not stop it
            load = self._loads[name] = asyncio.create_task(self._load(name))
            load.add_done_callback(lambda done: self._loads.pop(name, None))
            load.add_done_callback(_retrieved)
        return await asyncio.shield(load)

    def _lock(self, name: str) -> asyncio.Lock:
        """Held while collection `name` opens or closes: never both at once."""
        return self._locks.setdefault(name, asyncio.Lock())

    async def _load(self, name: str) -> OpenCollection:
        async with self._lock(name):
            opened = self._open.get(name)
            if opened is not None:
                return opened
            if not self.folder.is_collection(name):  # deleted while this load waited
                raise ApiError(404, "unknown_collection", f"no collection named {name!r}")
            try:
                model = await self._take_model(name)
            except (StartupError, StoreError, OSError) as exc:
                raise self._failed(name, exc) from None
            try:
                state = await asyncio.to_thread(
                    ServiceState.serving,
                    self.settings,
                    self.metrics,
                    model,
                    self.folder.directory(name),
                    self.decode_pool,
                    self.decode_budget,
                    owns_decode_pool=False,
                )
            except (StartupError, StoreError, OSError) as exc:
                await self._give_model(model)
                raise self._failed(name, exc) from None
            self._damaged.pop(name, None)
            closing = contextlib.AsyncExitStack()
            await closing.enter_async_context(maintained(state))
            closing.push_async_callback(self._give_model, model)
            self._open[name] = opened = OpenCollection(name, state, closing)
            logger.info("opened collection %s: %d items", name, len(state.store))
            return opened

    def _failed(self, name: str, exc: Exception) -> ApiError:
        self._damaged[name] = time.monotonic()  # the reason goes to the log
        logger.error("collection %s cannot be served: %s", name, exc)
        return _damaged_error(name)

    async def _take_model(self, name: str) -> ServedModel:
        """The loaded model of collection `name` (loaded from its model copy once per
        fingerprint), counted as used until `_give_model`."""
        directory = self.folder.directory(name)
        manifest = await asyncio.to_thread(mf.read_manifest, directory)
        entry = manifest.model
        if entry is None or entry.file is None or entry.fingerprint is None:
            raise StartupError(f"collection {name!r} keeps no model copy to embed queries with")
        async with self._models_lock:
            model = self._models.get(entry.fingerprint)
            if model is None:
                path = directory / entry.file
                model = await asyncio.to_thread(ServedModel.load, self.settings, path, self.metrics)
                await model.batcher.start()
                log_cpu_only(model.cpu_only)
                self._models[entry.fingerprint] = model
            self._model_users[entry.fingerprint] += 1
        return model

    async def _give_model(self, model: ServedModel) -> None:
        """One user fewer of `model`; the last one stops it and returns its memory."""
        fingerprint = model.embedder.fingerprint
        async with self._models_lock:
            self._model_users[fingerprint] -= 1
            if self._model_users[fingerprint] > 0:
                return
            del self._model_users[fingerprint]
            unused = self._models.pop(fingerprint, None)
        if unused is not None:
            await unused.batcher.stop()
        return_large_buffers_to_the_os()

    async def close(self, name: str, *, wait_s: float = 30.0, force: bool = False) -> bool:
        """Close collection `name` once its requests end (waiting at most `wait_s`;
        still in use then: False, left open, unless `force`, at shutdown). Requests
        meanwhile get 503 `collection_busy`. The close runs to its end even when the
        caller is cancelled (a half-closed store would keep its lock)."""
        if name in self._closing:
            return False
        return await self._exclusive(name, self._close(name, wait_s, force))

    async def _exclusive(self, name: str, work: Coroutine[Any, Any, bool]) -> bool:
        """Run `work` (a close or a delete) as the catalogue's task, to its end whatever
        happens to the caller, `name` marked closing (its requests get 503) meanwhile."""
        self._closing.add(name)
        task = asyncio.create_task(work)
        task.add_done_callback(lambda done: self._closing.discard(name))
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)

    async def _close(self, name: str, wait_s: float, force: bool) -> bool:
        async with self._lock(name):
            return await self._close_locked(name, wait_s, force)

    async def _close_locked(self, name: str, wait_s: float, force: bool) -> bool:
        opened = self._open.get(name)
        if opened is None:
            return True
        deadline = time.monotonic() + wait_s
        while opened.in_use and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if opened.in_use and not force:
            return False
        del self._open[name]
        await opened.closing.aclose()  # upkeep stopped, journal saved, model given back
        logger.info("closed collection %s", name)
        return True

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
        return [name for name in idle if await self.close(name, wait_s=0)]

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
            await self.close(name, wait_s=10.0, force=True)
        self.decode_pool.shutdown(wait=False, cancel_futures=True)

    # -- the collections and aliases -----------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        """What GET /v1/collections says of collection `name` (not opened for it)."""
        aliases = sorted(a for a, target in self.aliases().items() if target == name)
        entry: dict[str, Any] = {"name": name, "aliases": aliases, "open": name in self._open}
        damaged = entry | {"status": "damaged", "count": None, "dim": None, "model": None}
        opened = self._open.get(name)
        if name in self._damaged:
            return damaged
        try:
            if opened is not None:
                store = opened.state.store
                count, dim = len(store), store.dim
                broken = bool(store.damaged_segments())
                fingerprint = opened.state.embedder.fingerprint
            else:
                manifest = mf.read_manifest(self.folder.directory(name))
                count, dim, broken = manifest.count, manifest.dim, False
                fingerprint = manifest.fingerprint
        except (StoreError, OSError) as exc:
            logger.error("collection %s cannot be described: %s", name, exc)
            return damaged
        status = "damaged" if broken else "ok"
        return entry | {"status": status, "count": count, "dim": dim, "model": fingerprint}

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
        """Close collection `name` and delete its folder (its snapshots are moved
        aside). Refused first, with nothing closed: an alias's name, a collection an
        alias names (409), one a re-embedding reads (409), one still in use after 30 s
        (409). Its requests meanwhile get 503 `collection_busy`."""
        await on_folder(self.folder.check_deletable, name, self.aliases())
        if self.reembed_jobs.reading(name):
            raise ApiError(409, "job_running", f"a re-embedding job reads {name!r}")
        await self._exclusive(name, self._delete(name))

    async def _delete(self, name: str) -> bool:
        async with self._lock(name):
            if not await self._close_locked(name, 30.0, force=False):
                raise ApiError(409, "collection_busy", f"collection {name!r} is still in use")
            await on_folder(self.folder.delete, name)
            self._damaged.pop(name, None)
        return True


def _damaged_error(name: str) -> ApiError:
    reason = f"collection {name!r} cannot be opened; the server's log says why"
    return ApiError(503, "collection_damaged", reason)


def _retrieved(task: asyncio.Task) -> None:
    """Read a load's outcome, so a failure whose requests all gave up is not reported
    as never retrieved (the log has it already)."""
    if not task.cancelled():
        task.exception()


async def on_folder(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, an operation on the data folder (files, locks), in a
    thread; its refusals answered as `collection_error` says."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except StoreError as exc:
        raise collection_error(exc) from None
    except OSError as exc:  # the disk full or failing: the storage's trouble, a 503
        raise storage_error(exc) from None


def data_folder(path: Path | str | os.PathLike[str]) -> DataFolder:
    """The data folder at `path` (StartupError when there is none)."""
    try:
        return DataFolder(path)
    except StoreError as exc:
        raise StartupError(str(exc)) from None
