"""Embed a list of images into an index directory: resumable, and tolerant of bad files.

`build_index` is what `vitrieval-index build` and `add` run:

- items whose key is already in the index are skipped, so re-running an interrupted
  build continues where the last save left off;
- images are embedded and committed in chunks (`save_every`), each chunk ending with an
  atomic save, so a crash loses at most one chunk;
- files that cannot be decoded are skipped, counted, and listed in the report
  (`OUT/build_report.json`), and the build still succeeds;
- factories that need training (IVF, PQ) are trained on the embeddings of the whole
  list before anything is added.

`build_from_embeddings` is `vitrieval-index build --embeddings`: the same index from
an embeddings folder (`vitrieval.index.pipeline.embeddings_folder`) in bounded memory, for
catalogues whose
vectors do not fit in RAM at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..atomic import atomic_write_text
from ..evaluation.datasets import Item
from ..factory import MAX_TRAINING_VECTORS, training_sample_size
from ..progress import progress_bar
from ..runtime.embedder import Embedder, EmbedResult
from ..shards.store import ShardedStore, check_writable, is_index, open_index
from ..stopping import Stopped
from ..store import IndexStore, StoreError
from ..store.validation import check_new_keys, key_problem

if TYPE_CHECKING:  # pyarrow is imported only by builds from an embeddings folder
    from .embeddings_folder import EmbeddingBatch, EmbeddingsFolder

REPORT_FILE = "build_report.json"


@dataclass
class BuildReport:
    total: int = 0
    indexed: int = 0
    already_present: int = 0
    changed: int = 0  # already present, with another label or metadata in the input
    failed: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    images_per_s: float = 0.0
    index_size: int = 0

    def finish(self, out: Path, index_size: int, started: float) -> None:
        """Record the build's time since `started` (a perf_counter reading), its rate and
        the index's size, and write the report to out/REPORT_FILE."""
        self.seconds = time.perf_counter() - started
        self.images_per_s = self.indexed / self.seconds if self.seconds else 0.0
        self.index_size = index_size
        atomic_write_text(out / REPORT_FILE, json.dumps(asdict(self), indent=2))

    def summary(self, out: Path, unit: str = "images", origin: str = "") -> str:
        """The command's last line; `unit`: images or embeddings, `origin`: " from X"."""
        failed = len(self.failed)
        notes = f", {self.already_present} already present" if self.already_present else ""
        if self.changed:
            notes += (
                f" ({self.changed} with another label or metadata here: the index keeps its "
                "own; remove those keys and build again to take these)"
            )
        notes += f", {failed} unreadable skipped (see {out / REPORT_FILE})" if failed else ""
        finished = self.total and self.already_present == self.total
        per_s = "img/s" if unit == "images" else "vectors/s"
        rate = f" ({self.images_per_s:.0f} {per_s})" if self.indexed else ""
        return ("already finished, nothing to do: " if finished else "") + (
            f"indexed {self.indexed} of {self.total} {unit}{origin}{notes} in {self.seconds:.1f}s"
            f"{rate}; {out} holds {self.index_size} items"
        )


def open_or_create(out: Path, embedder: Embedder, factory: str | None) -> IndexStore | ShardedStore:
    """Open the index in `out` (checking it was built with this model) or start a new one."""
    if is_index(out):
        store = open_index(out, fingerprint=embedder.fingerprint, dim=embedder.dim)
        if factory and factory != store.factory:
            raise StoreError(f"{out} was built with factory {store.factory!r}, not {factory!r}")
        return store
    return IndexStore.create(
        out,
        dim=embedder.dim,
        factory=factory or "Flat",
        fingerprint=embedder.fingerprint,
        model_path=embedder.model_path,
    )


def _add_chunk(
    store: IndexStore | ShardedStore, items: Sequence[Item], embeddings: np.ndarray
) -> None:
    store.add(
        [item.key for item in items],
        embeddings,
        labels=[item.label for item in items],
        paths=[str(item.path) if item.path else None for item in items],
        metadata=[item.metadata for item in items],
    )


def build_index(
    items: Sequence[Item],
    out: Path,
    embedder: Embedder,
    *,
    factory: str | None = None,
    save_every: int = 2048,
    progress: bool = True,
    store: IndexStore | ShardedStore | None = None,
    on_image: Callable[[int], object] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> BuildReport:
    """Add `items` to the index in `out` (created if missing); returns what happened.

    `store`: the index in `out` when the caller has already opened it (with this
    embedder's model), to avoid loading and verifying it twice. `on_image(n)`: n more
    images read (a caller's own progress). `should_stop()`: asked after each batch;
    when true, what is embedded is saved and `Stopped` raised, as on Ctrl-C.
    """
    started = time.perf_counter()
    if store is None:
        store = open_or_create(out, embedder, factory)
    check_writable(out)  # a server holding the index: refused before any embedding
    report = BuildReport(total=len(items))
    todo = [item for item in items if item.key not in store]
    report.already_present = len(items) - len(todo)
    present = [item for item in items if item.key in store] if report.already_present else []
    report.changed = count_changed(
        store,
        [item.key for item in present],
        [item.label for item in present],
        [item.metadata for item in present],
    )
    check_new_keys(item.key for item in todo)  # before anything is embedded or saved

    def good_items(result: EmbedResult) -> list[Item]:
        for position, reason in result.errors:
            item = todo[position]
            report.failed.append({"key": item.key, "path": str(item.path or ""), "reason": reason})
        return [todo[i] for i in result.indices]

    if todo and store.needs_training():
        # IVF/PQ: learn the coarse quantiser from this data, then add everything at once.
        result = embedder.embed_items(todo, progress=progress)
        good = good_items(result)
        if not good:
            raise StoreError("no readable images to train the index on")
        rng = np.random.default_rng(0)
        store.train(result.embeddings[rng.permutation(len(good))[:MAX_TRAINING_VECTORS]])
        _add_chunk(store, good, result.embeddings)
        report.indexed = len(good)
    else:
        # The embedder streams batches without pausing its decode pipeline; commit every
        # `save_every` images so an interrupted build resumes close to where it stopped.
        since_save = 0
        before = len(store)
        # the bar moves as images are read, so it runs up to a batch ahead of the index
        bar = progress_bar(len(todo), "images", "embedding", enabled=progress)
        try:
            for result in embedder.iter_items(todo, on_image=_both(bar.update, on_image)):
                good = good_items(result)
                if good:
                    _add_chunk(store, good, result.embeddings)
                    report.indexed += len(good)
                since_save += len(result.indices) + len(result.errors)
                if since_save >= save_every:
                    store.save()
                    since_save = 0
                if should_stop is not None and should_stop():
                    raise _StopAsked
        except (KeyboardInterrupt, _StopAsked):
            store.save()  # Ctrl-C: keep every image embedded so far; a re-run skips them
            # what the index holds now, whatever the step the Ctrl-C landed in: the bar's
            # last line and the stop line both say it (the batch being embedded is not)
            kept = len(store) - before
            bar.update(kept + len(report.failed) - bar.n)
            unreadable = f" ({len(report.failed)} unreadable skipped)" if report.failed else ""
            raise Stopped(
                f"{kept} new image(s) saved{unreadable}, {out} holds {len(store)} items"
            ) from None
        finally:
            bar.close()
    store.save()  # also leaves a valid, empty index when there was nothing to add
    report.finish(out, len(store), started)
    return report


class _StopAsked(Exception):
    """`should_stop()` said so: handled as a Ctrl-C (saved, then `Stopped`)."""


def _both(
    first: Callable[[int], object], second: Callable[[int], object] | None
) -> Callable[[int], object]:
    if second is None:
        return first

    def both(n: int) -> None:
        first(n)
        second(n)

    return both


def build_from_embeddings(
    folder: EmbeddingsFolder,
    out: Path,
    store: IndexStore,
    *,
    save_every: int = 1_000_000,
    batch_size: int = 8192,
    progress: bool = True,
    keep: Callable[[str], bool] | None = None,
    first_id: int | None = None,
    check_keys: bool = True,
) -> BuildReport:
    """Add every row of `folder` to `store` (the index in `out`, opened or created for
    the folder's model); returns what happened.

    A shard of a sharded index (index.shards) is built with `keep`, which takes the
    rows whose key it returns True for (the others are read and skipped), and
    `first_id`: row r of the folder (counting every row, in file order) gets item id
    first_id + r, so that the shards number their items as one store would, and
    `check_keys=False` when the caller checked the keys once for all the shards.

    Memory stays bounded whatever the folder's size: one Parquet batch of at most
    `batch_size` rows at a time, the training sample, and 8 bytes per row for the
    duplicate-key check. The steps:

    1. keys are checked to be unique across all parts (a pass over the key column);
    2. when the factory needs training and the store is untrained, a uniform sample of
       `training_sample_size(factory)` vectors is drawn in one streaming pass
       (reservoir sampling, seed 0) and the quantiser is trained on it;
    3. the parts are added batch by batch, in file order, with a save every
       `save_every` vectors, so that a stopped build keeps what it saved and a re-run
       skips the keys already in the index.
    """
    started = time.perf_counter()
    report = BuildReport(total=folder.count if keep is None else 0)
    if check_keys:
        check_folder_keys(folder, store, batch_size)
    if folder.count and store.needs_training():
        store.train(folder.sample(training_sample_size(store.factory), batch_size))
    resuming = len(store) > 0
    before = len(store)
    since_save = 0
    row = 0  # rows of the folder read before this batch
    bar = progress_bar(folder.count, "vectors", "adding", enabled=progress)
    try:
        for batch in folder.iter_batches(batch_size):
            read = len(batch.keys)
            ids = np.arange(row, row + len(batch.keys), dtype=np.int64)
            row += len(batch.keys)
            if keep is not None:
                mine = [i for i, key in enumerate(batch.keys) if keep(key)]
                report.total += len(mine)
                batch, ids = _rows(batch, mine), ids[mine]
            new = [i for i, key in enumerate(batch.keys) if key not in store] if resuming else None
            if new is not None and len(new) < len(batch.keys):
                report.already_present += len(batch.keys) - len(new)
                old = sorted(set(range(len(batch.keys))) - set(new))
                report.changed += count_changed(
                    store,
                    [batch.keys[i] for i in old],
                    [batch.labels[i] for i in old],
                    [batch.metadata[i] for i in old],
                )
                batch, ids = _rows(batch, new), ids[new]
            if batch.keys:
                store.add(
                    batch.keys,
                    batch.embeddings,
                    labels=batch.labels,
                    paths=batch.paths,
                    metadata=batch.metadata,
                    ids=None if first_id is None else ids + first_id,
                )
                report.indexed += len(batch.keys)
                since_save += len(batch.keys)
            if since_save >= save_every:
                store.save()
                since_save = 0
            bar.update(read)  # after the add: the bar never shows rows a stop would lose
    except KeyboardInterrupt:
        store.save()  # Ctrl-C: keep every vector added so far; a re-run skips them
        raise Stopped(
            f"{len(store) - before} new vector(s) saved, {out} holds {len(store)} items"
        ) from None
    finally:
        bar.close()
    store.save()
    report.finish(out, len(store), started)
    return report


def count_changed(
    store: IndexStore | ShardedStore,
    keys: Sequence[str],
    labels: Sequence[str | None],
    metadata: Sequence[dict | None],
) -> int:
    """How many of `keys`, already in `store`, come with another label or metadata than
    the index holds: a build skips present keys, so a list edited since says so.

    Only entries that give a label or metadata are read back (one item read each): a
    resumed folder build without labels, the common large resume, reads nothing."""
    changed = 0
    for key, label, meta in zip(keys, labels, metadata, strict=True):
        if label is None and not meta:
            continue
        record = store.get(key)
        if record is not None and (record.label != label or record.metadata != (meta or {})):
            changed += 1
    return changed


def check_folder_keys(folder: EmbeddingsFolder, store: IndexStore | None, batch_size: int) -> None:
    """The keys of an embeddings folder, before any is added: unique, and each one a
    new item may have (`check_new_keys`) unless `store` holds it already (a resumed
    build, or an index of an earlier version)."""
    folder.check_unique_keys(batch_size)
    for part, keys in folder.iter_keys(batch_size):
        refused = [key for key in keys if key_problem(key)]
        if store is not None:
            refused = [key for key in refused if key not in store]
        check_new_keys(refused, f"{part}: ")


def _rows(batch: EmbeddingBatch, keep: list[int]) -> EmbeddingBatch:
    """The rows `keep` of a batch."""
    return replace(
        batch,
        keys=[batch.keys[i] for i in keep],
        embeddings=batch.embeddings[keep],
        labels=[batch.labels[i] for i in keep],
        paths=[batch.paths[i] for i in keep],
        metadata=[batch.metadata[i] for i in keep],
    )
