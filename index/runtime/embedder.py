"""Embed images with an exported vitrieval model on ONNX Runtime (no torch).

The model file describes itself (`vitrieval.index.runtime.model_metadata`): the preprocessing comes
from
its metadata, never from arguments, so an index is always embedded the way the model
was trained.

Throughput comes from overlapping the two halves of the work. Decoding and resizing
(PIL, numpy) run in a thread pool and fill batch i+1 while ONNX Runtime computes batch
i; both release the GIL, so threads are enough. Only two batches are ever in flight,
which bounds memory whatever the number of inputs.

Bad inputs are data, not bugs: `embed_sources` and `embed_items` skip files that fail
to decode and report them (position, reason) instead of raising, so one corrupt file
in a catalogue of 100k does not stop a build.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnxruntime as ort
from PIL import Image

from ..evaluation.datasets import Item
from ..gpu_notice import say_cpu_only
from ..progress import progress_bar
from ..unit_vectors import l2_normalize
from .images import (
    DEFAULT_MAX_PIXELS,
    DecodeBudget,
    ImageDecodeError,
    open_image,
    plan_decode,
)
from .model_metadata import (
    INPUT_NAME,
    OUTPUT_NAME,
    ModelMetadata,
    ModelMetadataError,
    model_file,
)
from .preprocess import Preprocessor
from .vips_decode import decoder_setting

logger = logging.getLogger("vitrieval.embedder")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "tensorrt")
"""Accepted `device` values (N is a GPU ordinal)."""

T = TypeVar("T")


@dataclass
class EmbedResult:
    """Embeddings of the inputs that decoded, and why the others did not.

    `embeddings` is float32 (M, D), L2-normalised; row r belongs to input position
    `indices[r]` (ascending). `errors` holds (input position, reason) for the rest, so
    M + len(errors) equals the number of inputs.
    """

    embeddings: np.ndarray
    indices: list[int] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)


class Embedder:
    """An exported model loaded into ONNX Runtime, with a decoding pipeline in front.

    `device`: "auto" (CUDA when onnxruntime-gpu provides it, else CPU), "cpu", "cuda"
    or "cuda:N", or "tensorrt" (never picked automatically: its engine build takes
    minutes). `batch_size` bounds both the model batch and memory; `decode_threads`
    defaults to min(4, CPU count); `intra_op_threads` is ONNX Runtime's own thread
    count (None: its default, one per core); `max_pixels` guards against
    decompression bombs in `embed_sources`. JPEG files are decoded at reduced scale
    when the model shrinks them anyway (`exact_decode=False`, the default: 2-4x faster
    decoding, embeddings within cosine 0.999 of the exact path); `exact_decode=True`
    decodes every pixel. `spin_wait=False` stops ONNX Runtime's threads busy-waiting
    between calls (what a server sharing its cores wants).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        batch_size: int = 64,
        decode_threads: int | None = None,
        intra_op_threads: int | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        exact_decode: bool = False,
        spin_wait: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        decoder_setting()  # a bad VITRIEVAL_DECODER: one error now, not one per image
        self.model_path = model_file(model_path)
        self.batch_size = batch_size
        self.decode_threads = decode_threads or min(4, os.cpu_count() or 1)
        self.max_pixels = max_pixels
        providers = select_providers(device)
        self._session = _create_session(self.model_path, providers, intra_op_threads, spin_wait)
        self.provider: str = self._session.get_providers()[0]
        if self.provider != providers[0][0]:
            logger.warning(
                "%s was requested but ONNX Runtime could not use it; running on %s",
                providers[0][0],
                self.provider,
            )
        self.metadata: ModelMetadata = _read_metadata(self._session, self.model_path)
        _check_signature(self._session, self.metadata, self.model_path)
        self.dim: int = self.metadata.embedding_dim
        self.fingerprint: str = self.metadata.fingerprint
        self.input_size: int = self.metadata.input_size[1]
        self._preprocess = Preprocessor(self.metadata)
        # JPEGs are decoded at reduced scale (index.runtime.preprocess.DRAFT_FACTOR: what `fit`
        # evaluates with too); exact_decode=True decodes at full resolution.
        self.draft_size: int | None = None if exact_decode else self._preprocess.draft_size
        # seconds spent in ONNX Runtime so far: the pipeline overlaps decoding with the
        # model, so a caller timing a whole pass cannot tell the two apart otherwise
        self.model_seconds: float = 0.0
        self._model_thread: ThreadPoolExecutor | None = None  # see _run_interruptible
        logger.info(
            "embedding with %s on %s (%d-d, %dx%d input)",
            self.model_path.name,
            self.provider,
            self.dim,
            self.input_size,
            self.input_size,
        )

    def __repr__(self) -> str:
        return (
            f"Embedder({str(self.model_path)!r}, provider={self.provider!r}, dim={self.dim}, "
            f"batch_size={self.batch_size})"
        )

    def embed_arrays(self, batch: np.ndarray) -> np.ndarray:
        """Preprocessed float32 (B, 3, S, S) -> float32 (B, D), unit rows.

        Runs in chunks of `batch_size`, so any B fits in memory.
        """
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        expected = (3, self.input_size, self.input_size)
        if batch.ndim != 4 or batch.shape[1:] != expected:
            raise ValueError(
                f"expected a (B, {', '.join(map(str, expected))}) batch, got {batch.shape}"
            )
        if len(batch) == 0:
            return np.zeros((0, self.dim), np.float32)
        chunks = [
            self._run(batch[start : start + self.batch_size])
            for start in range(0, len(batch), self.batch_size)
        ]
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def prepare(
        self, source: str | os.PathLike[str] | bytes, budget: DecodeBudget | None = None
    ) -> np.ndarray:
        """Decode and preprocess one image exactly as the batch pipeline does:
        a path or encoded bytes -> float32 (3, S, S), ready for `embed_arrays`.

        For callers that batch on their own (the HTTP service). With `budget`, the
        decode's memory (known from the header) is reserved there first. Raises
        ImageDecodeError (or a subclass) for an unreadable, oversized, disallowed or
        corrupt image, DecodeBudgetBusy when the budget stays full.
        """
        if budget is None:
            return self._preprocess(open_image(source, self.max_pixels, self.draft_size))
        plan = plan_decode(source, self.max_pixels, self.draft_size)
        with budget.reserve(plan.peak_bytes + self._preprocess.peak_bytes(plan.output_size)):
            return self._preprocess(open_image(source, self.max_pixels, self.draft_size))

    def embed_images(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Decoded PIL images (any size; converted to RGB) -> float32 (N, D), unit rows.

        Preprocessing runs in the thread pool, overlapped with the model.
        """
        parts = [r.embeddings for r in self._iter(images, lambda im: im, tolerant=False)]
        return np.concatenate(parts) if parts else np.zeros((0, self.dim), np.float32)

    def embed_sources(
        self, sources: Sequence[str | os.PathLike[str] | bytes], *, progress: bool = False
    ) -> EmbedResult:
        """Image files (paths) or encoded images (bytes) -> `EmbedResult`.

        Inputs that cannot be read or decoded safely are listed in `errors`, never raised.
        """
        return _concat(self.iter_sources(sources, progress=progress), self.dim)

    def embed_items(self, items: Sequence[Item], *, progress: bool = False) -> EmbedResult:
        """Dataset items (read with `Item.open`) -> `EmbedResult`; positions index `items`."""
        return _concat(self.iter_items(items, progress=progress), self.dim)

    def iter_sources(
        self, sources: Sequence[str | os.PathLike[str] | bytes], *, progress: bool = False
    ) -> Iterator[EmbedResult]:
        """Like `embed_sources`, one `EmbedResult` per batch (positions global).

        For callers that save as they go (a resumable index build): the pipeline keeps
        running between batches, so streaming costs no throughput.
        """
        for position, source in enumerate(sources):
            if not isinstance(source, str | bytes | os.PathLike):
                raise TypeError(
                    f"source {position} is a {type(source).__name__}, expected a path or bytes"
                )
        return self._iter(
            sources,
            lambda s: open_image(s, self.max_pixels, self.draft_size),
            tolerant=True,
            progress=progress,
        )

    def iter_items(
        self,
        items: Sequence[Item],
        *,
        progress: bool = False,
        on_image: Callable[[int], object] | None = None,
    ) -> Iterator[EmbedResult]:
        """Like `embed_items`, one `EmbedResult` per batch (positions global).
        `on_image(1)` is called as each image is read (for a caller's own progress)."""
        return self._iter(
            items,
            lambda item: item.open(self.max_pixels, self.draft_size),
            tolerant=True,
            progress=progress,
            on_image=on_image,
        )

    def _run(self, chunk: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        if threading.current_thread() is threading.main_thread():
            out = self._run_interruptible(chunk)
        else:
            (out,) = self._session.run([OUTPUT_NAME], {INPUT_NAME: chunk})
        self.model_seconds += time.perf_counter() - started
        # the exported model already normalises; doing it again is cheap and keeps the
        # inner-product-is-cosine contract for quantised models, whose last ops are
        # approximate
        return l2_normalize(out)

    def _run_interruptible(self, chunk: np.ndarray) -> np.ndarray:
        """The model on `chunk` in a helper thread, the main thread waiting: Python runs
        a Ctrl-C handler only between bytecodes of the main thread, which a model call of
        seconds (a large batch on a loaded CPU) would otherwise hold off until it ends.
        On Ctrl-C the call is told to stop at its next operator."""
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="vitrieval-model")
        options = ort.RunOptions()
        future = self._model_thread.submit(
            self._session.run, [OUTPUT_NAME], {INPUT_NAME: chunk}, options
        )
        try:
            (out,) = future.result()
        except KeyboardInterrupt:
            options.terminate = True
            raise
        return out

    def _iter(
        self,
        inputs: Sequence[T],
        load: Callable[[T], Image.Image],
        *,
        tolerant: bool,
        progress: bool = False,
        on_image: Callable[[int], object] | None = None,
    ) -> Iterator[EmbedResult]:
        """The pipeline: decode batch i+1 in the pool while the model runs batch i.
        Progress moves image by image as each is read: a batch of large images can take
        a minute, and a bar moved per batch would sit still for all of it."""
        count, size = len(inputs), self.batch_size
        prepare = self._prepare_tolerant(load) if tolerant else self._prepare_strict(load)
        pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="vitrieval-decode")
        bar = progress_bar(count, "images", "embedding", enabled=progress)

        def advance(n: int) -> None:
            bar.update(n)
            if on_image is not None:
                on_image(n)

        def submit(start: int) -> list[tuple[int, Future[Any]]]:
            stop = min(start + size, count)
            return [(i, pool.submit(prepare, inputs[i])) for i in range(start, stop)]

        interrupted = False
        try:
            pending = submit(0) if count else []
            for start in range(0, count, size):
                current = pending
                # Queue the next batch before blocking on this one: the pool decodes it
                # while ONNX Runtime (which releases the GIL) runs this one.
                pending = submit(start + size) if start + size < count else []
                arrays, indices, errors = _collect(current, advance)
                embeddings = (
                    self._run(np.stack(arrays)) if arrays else np.zeros((0, self.dim), np.float32)
                )
                yield EmbedResult(embeddings, indices, errors)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            # On an error or an abandoned generator, drop queued work instead of finishing
            # it; on Ctrl-C do not wait either: the decodes under way end on their own.
            pool.shutdown(wait=not interrupted, cancel_futures=True)
            bar.close()

    def _prepare_strict(self, load: Callable[[T], Image.Image]) -> Callable[[T], np.ndarray]:
        return lambda value: self._preprocess(load(value))

    def _prepare_tolerant(
        self, load: Callable[[T], Image.Image]
    ) -> Callable[[T], np.ndarray | str]:
        """Worker that returns the failure reason instead of raising."""

        def prepare(value: T) -> np.ndarray | str:
            try:
                return self._preprocess(load(value))
            except ImageDecodeError as exc:
                return str(exc)
            except Exception as exc:
                # PIL plugins can raise odd types (struct.error, IndexError...) on hostile
                # files that slip past open_image; a batch job must survive them too.
                logger.debug("unexpected decode failure", exc_info=True)
                return f"cannot decode image ({type(exc).__name__}: {exc})"

        return prepare


def ort_cpu_reason() -> str:
    """Why device="auto" embeds on the CPU, for `vitrieval.index.gpu_notice.say_cpu_only`."""
    return (
        f"no {CUDA} (it has {', '.join(ort.get_available_providers())}; "
        "onnxruntime-gpu in place of onnxruntime enables CUDA)"
    )


def select_providers(device: str, *, log: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """ONNX Runtime providers for `device`, best first, CPU always last as a fallback
    (`log`: say why `auto` stays on the CPU; off for a caller only asking, so the
    Embedder that then loads the model says it once)."""
    available = ort.get_available_providers()
    name, _, ordinal = device.lower().partition(":")
    options: dict[str, Any] = {"device_id": int(ordinal)} if ordinal.isdigit() else {}
    if name == "cpu" and not ordinal:
        return [(CPU, {})]
    if name == "auto" and not ordinal:
        if CUDA in available:
            return [(CUDA, {}), (CPU, {})]
        if log:
            say_cpu_only({"onnxruntime": ort_cpu_reason()})
        return [(CPU, {})]
    if name in ("cuda", "tensorrt") and (ordinal.isdigit() or not ordinal):
        needed = [TENSORRT, CUDA] if name == "tensorrt" else [CUDA]
        missing = [p for p in needed if p not in available]
        if missing:
            raise ValueError(
                f"device={device!r} needs {' and '.join(missing)}, but this onnxruntime only "
                f"has {', '.join(available)}; install onnxruntime-gpu (in place of "
                "onnxruntime) on a machine with a CUDA GPU, or use device='auto' or 'cpu'"
            )
        return [(p, dict(options)) for p in needed] + [(CPU, {})]
    raise ValueError(f"unknown device {device!r}; choose one of: {', '.join(DEVICES)}")


def _create_session(
    path: Path,
    providers: list[tuple[str, dict[str, Any]]],
    intra_op_threads: int | None,
    spin_wait: bool = True,
) -> ort.InferenceSession:
    if not path.is_file():
        raise ModelMetadataError(f"model file not found: {path}")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ORT's own warnings are noise here; we log our own
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    if not spin_wait:
        # ORT's threads busy-wait between calls by default: fastest on a machine of its
        # own, a waste of the cores a server shares with its event loop and decoding
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:
        if providers[0][0] == CPU:
            raise ModelMetadataError(f"{path} is not a loadable ONNX model: {exc}") from None
        # A GPU provider can fail at session creation (driver, cuDNN, TensorRT libraries
        # missing, out of memory): the next provider (TensorRT -> CUDA -> CPU) is slower
        # but correct, so fall back rather than fail.
        rest = providers[1:]
        fallback = "CPU" if rest[0][0] == CPU else rest[0][0]
        logger.warning(
            "cannot create a %s session (%s); falling back to %s", providers[0][0], exc, fallback
        )
        return _create_session(path, rest, intra_op_threads, spin_wait)


def _read_metadata(session: ort.InferenceSession, path: Path) -> ModelMetadata:
    props = dict(session.get_modelmeta().custom_metadata_map)
    try:
        return ModelMetadata.from_properties(props)
    except ModelMetadataError as exc:
        raise ModelMetadataError(
            f"{path} is not a vitrieval model: {exc} (export one with `vitrieval-train export`)"
        ) from None


def _check_signature(session: ort.InferenceSession, meta: ModelMetadata, path: Path) -> None:
    """The exported-model contract (docs/training.md): one input `images` (B, 3, H, W),
    one output `embeddings` (B, D)."""
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if [i.name for i in inputs] != [INPUT_NAME] or [o.name for o in outputs] != [OUTPUT_NAME]:
        raise ModelMetadataError(
            f"{path}: expected one input {INPUT_NAME!r} and one output {OUTPUT_NAME!r}, got "
            f"inputs {[i.name for i in inputs]} and outputs {[o.name for o in outputs]}"
        )
    in_shape, out_shape = inputs[0].shape, outputs[0].shape
    if len(in_shape) != 4 or len(out_shape) != 2:
        raise ModelMetadataError(
            f"{path}: expected input (B, 3, H, W) and output (B, D), got {in_shape} and {out_shape}"
        )
    # Static sizes in the graph must agree with the metadata that drives preprocessing.
    declared = [*in_shape[1:], out_shape[1]]
    wanted = [*meta.input_size, meta.embedding_dim]
    if any(isinstance(d, int) and d != w for d, w in zip(declared, wanted, strict=True)):
        raise ModelMetadataError(
            f"{path}: graph shapes {in_shape} -> {out_shape} disagree with the metadata "
            f"(input {list(meta.input_size)}, embedding_dim {meta.embedding_dim})"
        )


def _collect(
    futures: list[tuple[int, Future[Any]]],
    advance: Callable[[int], None],
) -> tuple[list[np.ndarray], list[int], list[tuple[int, str]]]:
    """Wait for one batch, in input order: (arrays, their positions, failures);
    `advance(1)` after each image."""
    arrays: list[np.ndarray] = []
    indices: list[int] = []
    errors: list[tuple[int, str]] = []
    for index, future in futures:
        value = future.result()
        advance(1)
        if isinstance(value, str):
            errors.append((index, value))
        else:
            arrays.append(value)
            indices.append(index)
    return arrays, indices, errors


def _concat(results: Iterator[EmbedResult], dim: int) -> EmbedResult:
    parts, indices, errors = [], [], []
    for result in results:
        parts.append(result.embeddings)
        indices.extend(result.indices)
        errors.extend(result.errors)
    embeddings = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
    return EmbedResult(embeddings, indices, errors)
