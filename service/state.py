"""What the service holds while it runs: one model, one index, the batcher, the
metrics. Built once (in the lifespan handler, or by the CLI before the server starts)
and reached by routes through the `ServiceDep` dependency."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vitrieval.index.atomic import atomic_write_bytes, fsync_dir
from vitrieval.index.contract import Index, LocalIndex
from vitrieval.index.follow import CommitFollower
from vitrieval.index.gpu_notice import claim_cpu_only, log_cpu_only
from vitrieval.index.runtime.embedder import CPU, Embedder, ort_cpu_reason, select_providers
from vitrieval.index.runtime.images import DecodeBudget, DecodeBudgetBusy
from vitrieval.index.shards import ShardedStore, open_index
from vitrieval.index.store import IndexStore, check_gpu_mode, faiss_cpu_reason
from vitrieval.index.store.manifest import UPLOADS_DIR
from vitrieval.index.unit_vectors import unit_rows

from .batching import DynamicBatcher
from .duplicates import DuplicateJobs
from .errors import ApiError, image_error
from .inputs import ImageUpload
from .layout import model_layout
from .metrics import ServiceMetrics
from .settings import Settings
from .upkeep import CheckpointStatus

logger = logging.getLogger("vitrieval.service")


class StartupError(RuntimeError):
    """The model or the index cannot be served; the message says why."""


@dataclass
class Timings:
    """Milliseconds per stage of one request."""

    decode: float = 0.0
    embed: float = 0.0
    search: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "decode": round(self.decode, 3),
            "embed": round(self.embed, 3),
            "search": round(self.search, 3),
        }


@dataclass
class ServedModel:
    """A loaded model, its batcher and its self-check: one per model fingerprint, shared
    by every collection that model embeds."""

    embedder: Embedder
    batcher: DynamicBatcher
    self_check: dict[str, Any]
    cpu_only: dict[str, str]
    """Why each library runs on the CPU, for one log line once serving (log_cpu_only):
    a start-up that fails ends with its one error line alone."""

    @classmethod
    def load(cls, settings: Settings, model: Path, metrics: ServiceMetrics) -> ServedModel:
        """Load `model` and run the self-check; StartupError on failure."""
        from vitrieval.index.runtime.images import ImageDecodeError

        try:
            on_gpu = select_providers(settings.device, log=False)[0][0] != CPU
        except ValueError:  # an unknown device: the Embedder below says so
            on_gpu = False
        # claimed now: the embedder and every segment stay silent
        cpu_only = _claim_cpu_only(on_gpu, settings.device)
        layout = model_layout(settings, on_gpu)
        try:
            embedder = Embedder(
                model, device=settings.device, batch_size=settings.max_batch_size,
                intra_op_threads=layout.intra_op_threads, max_pixels=settings.max_pixels,
                spin_wait=settings.ort_spin_wait,
            )  # fmt: skip
        except Exception as exc:  # ModelMetadataError, OSError, and ONNX Runtime's own types
            raise StartupError(f"cannot load model {model}: {exc}") from None
        try:
            checked = self_check(embedder, embedder.dim)
        except (ImageDecodeError, ValueError, RuntimeError) as exc:
            raise StartupError(f"self-check failed: {exc}") from None
        batcher = DynamicBatcher(
            embedder.embed_arrays,
            enabled=layout.batching,
            max_batch=settings.max_batch_size,
            max_wait_s=settings.max_batch_wait_ms / 1000,
            on_batch=metrics.batch_size.observe,
            unbatched_threads=layout.concurrent_calls,
        )
        return cls(embedder, batcher, checked, cpu_only)


@dataclass
class ServiceState:
    """The model and index loaded in this process. The routes reach the index through
    `index` (index.contract.Index) and embed through `embed_bytes` / `embed_upload`; the
    Ray Serve ingress (distributed.serve) gives them an object with the same surface
    whose index and model live in other processes."""

    settings: Settings
    embedder: Embedder
    store: IndexStore | ShardedStore  # one store, or a sharded index (index.shards)
    metrics: ServiceMetrics
    batcher: DynamicBatcher
    decode_pool: ThreadPoolExecutor
    decode_budget: DecodeBudget
    self_check: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: float = field(default_factory=time.time)
    evaluating: asyncio.Lock = field(default_factory=asyncio.Lock)
    # read-only: follows a writer's commits (`store` is then the first one opened)
    follower: CommitFollower | None = None
    checkpoints: CheckpointStatus = field(default_factory=CheckpointStatus)
    duplicate_jobs: DuplicateJobs = field(default_factory=DuplicateJobs)  # POST /v1/duplicates
    owns_decode_pool: bool = True
    index: Index = field(init=False)

    def __post_init__(self) -> None:
        self.index = LocalIndex(self.store, self.follower)

    def current_store(self) -> IndexStore | ShardedStore:
        """The store answering now: a read-only server's moves with the writer's commits."""
        return self.follower.store if self.follower is not None else self.store

    @classmethod
    def load(cls, settings: Settings, metrics: ServiceMetrics | None = None) -> ServiceState:
        """Load the model and the index and run the self-check; StartupError on failure."""
        if settings.model is None or settings.index is None:
            raise StartupError("both a model (--model) and an index (--index) are needed")
        metrics = metrics or ServiceMetrics()
        model = ServedModel.load(settings, settings.model, metrics)
        state = cls.serving(settings, metrics, model, settings.index, *decoding(settings))
        log_cpu_only(model.cpu_only)
        metrics.track_index(
            lambda: len(state.current_store()),
            lambda: state.current_store().journal_pending,
            lambda: len(state.current_store().damaged_segments()),
        )
        return state

    @classmethod
    def serving(
        cls,
        settings: Settings,
        metrics: ServiceMetrics,
        model: ServedModel,
        index: Path,
        decode_pool: ThreadPoolExecutor,
        decode_budget: DecodeBudget,
        *,
        owns_decode_pool: bool = True,
    ) -> ServiceState:
        """The index in `index` served with the loaded `model` (StartupError when it
        cannot be: missing, damaged, or of another model); `decode_pool` closes with the
        state when it `owns_decode_pool` (a data folder's collections share one)."""
        from vitrieval.index.store import StoreError

        embedder = model.embedder

        def opener() -> IndexStore | ShardedStore:
            return open_index(
                index,
                fingerprint=embedder.fingerprint,
                dim=embedder.dim,
                journal=not settings.read_only,
            )

        try:
            follower = CommitFollower(index, opener) if settings.read_only else None
            store = follower.store if follower is not None else opener()
        except (StoreError, OSError) as exc:
            raise StartupError(f"cannot open index {index}: {exc}") from None
        state = cls(
            settings=settings,
            embedder=embedder,
            store=store,
            metrics=metrics,
            batcher=model.batcher,
            decode_pool=decode_pool,
            decode_budget=decode_budget,
            follower=follower,
            self_check=model.self_check,
            owns_decode_pool=owns_decode_pool,
        )
        if store.dim != embedder.dim:  # a sharded index checks its shards, not itself
            state.close()
            raise StartupError(
                f"self-check failed: the model embeds {embedder.dim}, the index holds {store.dim}"
            )
        return state

    # -- the query pipeline --------------------------------------------------------------

    async def decode(self, data: bytes, timings: Timings, name: str = "the image") -> np.ndarray:
        """Encoded image -> preprocessed float32 (3, S, S), in the decode pool; errors
        call the image `name`."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(
            self.decode_pool, prepare_image, self.embedder, data, self.decode_budget, name
        )
        timings.decode = _elapsed_ms(started)
        self.metrics.observe_stage("decode", timings.decode / 1000)
        return image

    async def embed(self, image: np.ndarray, timings: Timings) -> np.ndarray:
        started = time.perf_counter()
        vector = await self.batcher.embed(image)
        timings.embed = _elapsed_ms(started)
        self.metrics.observe_stage("embed", timings.embed / 1000)
        return vector

    async def embed_bytes(
        self, data: bytes, timings: Timings, name: str = "the image"
    ) -> np.ndarray:
        """Encoded image -> float32 (D,) unit vector, through decode pool and batcher."""
        return await self.embed(await self.decode(data, timings, name), timings)

    async def embed_upload(self, upload: ImageUpload, timings: Timings) -> np.ndarray:
        return await self.embed_bytes(upload.data, timings, upload.name)

    def save_upload(self, data: bytes) -> tuple[Path | None, bool]:
        """Keep an image added through the API (for thumbnails): `keep_upload`."""
        if not self.settings.store_uploads:
            return None, False
        return keep_upload(Path(self.store.directory), data)

    def check_vector(self, values: list[float]) -> np.ndarray:
        return check_vector(values, self.store.dim)

    def close(self) -> None:
        if self.owns_decode_pool:
            self.decode_pool.shutdown(wait=False, cancel_futures=True)
        if self.follower is not None:
            self.follower.close()
        self.store.close()


def decoding(settings: Settings) -> tuple[ThreadPoolExecutor, DecodeBudget]:
    """The threads that decode uploaded images and the memory their decodes may hold."""
    pool = ThreadPoolExecutor(settings.decode_threads, thread_name_prefix="vitrieval-decode")
    wait_s = min(10.0, settings.request_timeout_s)
    return pool, DecodeBudget(settings.decode_memory_bytes, wait_s=wait_s)


def keep_upload(index: Path, data: bytes) -> tuple[Path, bool]:
    """Keep an image added through the API under INDEX/uploads, named by its content
    hash; returns (its path, whether this call created it)."""
    digest = hashlib.sha256(data).hexdigest()
    path = index.resolve() / UPLOADS_DIR / digest[:2] / digest
    if path.exists():
        return path, False
    folders = [p for p in (path.parent.parent, path.parent) if not p.exists()]
    atomic_write_bytes(path, data)
    for folder in folders:  # new folders' own entries must survive a power cut too
        fsync_dir(folder.parent)
    return path, True


def self_check(embedder: Embedder, dim: int) -> dict[str, Any]:
    """Embed a synthetic image and check what comes back: finite, unit norm, `dim` (the
    index's). Run once at start; /readyz reports it. RuntimeError says what is wrong."""
    ramp = np.linspace(0, 255, 64 * 64 * 3).reshape(64, 64, 3).astype(np.uint8)
    image = embedder.prepare(_png_bytes(Image.fromarray(ramp)))
    vector = embedder.embed_arrays(image[None])[0]
    norm = float(np.linalg.norm(vector))
    if not np.all(np.isfinite(vector)) or abs(norm - 1) > 1e-3:
        raise RuntimeError(f"the model returned a non-unit embedding (norm {norm})")
    if vector.shape != (dim,):
        raise RuntimeError(f"the model embeds {vector.shape}, the index holds {dim}")
    return {"embedding_norm": round(norm, 6), "dim": int(vector.shape[0]), "passed": True}


def prepare_image(
    embedder: Embedder, data: bytes, budget: DecodeBudget, name: str = "the image"
) -> np.ndarray:
    """Encoded image -> preprocessed float32 (3, S, S), its decode's memory reserved in
    `budget`; what is wrong with the image is an ApiError that calls it `name`."""
    try:
        return embedder.prepare(data, budget)
    except DecodeBudgetBusy as exc:
        raise ApiError(503, "overloaded", f"{exc}; retry shortly", {"Retry-After": "1"}) from None
    except (MemoryError, RuntimeError):
        raise  # the server's trouble (memory, a pool shut down), not the image's
    except Exception as exc:  # hostile files make PIL plugins raise assorted types
        raise image_error(exc, name) from None


def check_vector(values: list[float], dim: int) -> np.ndarray:
    """A vector from a client (a query, an item), checked against the index's `dim` and
    normalised (`vitrieval.index.unit_vectors`: any finite values, however large or small, that
    are not all zero)."""
    vector = np.asarray(values, dtype=np.float64)
    if vector.shape != (dim,):
        raise ApiError(422, "bad_vector", f"vector has {vector.size} values, the index is {dim}-d")
    if not np.isfinite(vector).all():
        at = int(np.flatnonzero(~np.isfinite(vector))[0])
        raise ApiError(
            422,
            "bad_vector",
            f"vector[{at}] is not a finite number (NaN, or infinite: JSON numbers beyond "
            "1.8e308 read as infinity)",
        )
    unit, ok = unit_rows(vector[None, :])
    if not ok[0]:
        raise ApiError(422, "bad_vector", "vector is all zeros: it has no direction")
    return unit[0]


def _elapsed_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _png_bytes(image: Image.Image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _claim_cpu_only(model_on_gpu: bool, device: str) -> dict[str, str]:
    """On a host without a GPU, why each library runs on the CPU, claimed for one
    start-up line (the embedder and every index segment would each say it again
    otherwise; `vitrieval.index.gpu_notice`)."""
    reasons = {}
    if not model_on_gpu and device.lower() == "auto":
        reasons["onnxruntime"] = ort_cpu_reason()
    if not check_gpu_mode("auto"):  # the service opens its index with gpu="auto"
        reasons["FAISS"] = faiss_cpu_reason()
    return claim_cpu_only(reasons)
