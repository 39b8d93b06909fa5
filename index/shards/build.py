"""Building a sharded index from an embeddings folder: the quantiser trained once, on
the sample an unsharded build trains on, then every shard built apart.

`build_shard` builds one shard, with only picklable arguments, so that a process pool
(the default, `run_locally`) or a remote task (a Ray cluster) can run it; every shard
reads the whole folder and keeps the rows whose key it owns, in the bounded memory of
`vitrieval.index.pipeline.build_index.build_from_embeddings`. `build_sharded` plans the build,
trains, runs the shards through `run_shards`, and commits: it writes shards.json last.

Resuming: each shard resumes as an unsharded build does (the keys it saved are
skipped); the plan (shards.build.json) and the trained quantiser stay in the folder
until shards.json is written, so re-running the same command after a kill carries on
with the same quantiser and the same item numbering.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import faiss

from ..atomic import atomic_write_bytes, atomic_write_text
from ..factory import training_sample_size
from ..json_text import parse_json
from ..pipeline.build_index import REPORT_FILE, build_from_embeddings, check_folder_keys
from ..pipeline.embeddings_folder import BATCH_ROWS, EmbeddingsError, EmbeddingsFolder
from ..store import IndexStore, StoreError, VectorIndex, new_faiss_index
from ..store import manifest as mf
from .layout import (
    PLAN_FILE,
    QUANTIZER_FILE,
    SHARD_PREFIX,
    ShardsManifest,
    is_sharded,
    read_shards_manifest,
    shard_name,
    shard_of,
    write_shards_manifest,
)

_PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>

RunShards = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


class _Owns:
    """`key -> whether shard `shard` of `shards` owns it`, picklable (not a lambda)."""

    def __init__(self, shard: int, shards: int) -> None:
        self.shard, self.shards = shard, shards

    def __call__(self, key: str) -> bool:
        return shard_of(key, self.shards) == self.shard


def build_shard(
    embeddings: str,
    shard_dir: str,
    shard: int,
    shards: int,
    model: str,
    factory: str,
    quantizer: bytes | None,
    save_every: int,
) -> dict:
    """Build (or resume) shard `shard` of `shards` in `shard_dir` from the embeddings
    folder `embeddings`: the rows whose key it owns, added in file order with a save
    every `save_every`. A new shard starts from `quantizer` (the trained, empty index
    of `factory`, faiss.serialize_index bytes; None for factories without training);
    shard 0 keeps the copy of `model` ('' keeps none). Returns the shard's BuildReport as a dict.

    The item ids follow the plan build_sharded left beside the shards (its first id
    plus the row's position in the folder), so the shards rank equal scores as one
    store would; without a plan (a shard built on its own) the store numbers them.
    """
    folder = EmbeddingsFolder.open(embeddings)
    directory = Path(shard_dir)
    plan = _read_plan(directory.parent)
    if (directory / mf.MANIFEST).exists():
        store = IndexStore.open(directory, fingerprint=folder.fingerprint, dim=folder.dim)
        if store.factory != factory:
            store.close()
            raise StoreError(
                f"{directory} was built with factory {store.factory!r}, not {factory!r}"
            )
    else:
        # nothing committed here yet: whatever an interrupted first save left is debris
        store = IndexStore.create(
            directory,
            dim=folder.dim,
            factory=factory,
            fingerprint=folder.fingerprint,
            model_path=Path(model) if shard == 0 and model else None,
            overwrite=True,
            quantizer=quantizer,
        )
    with store:
        report = build_from_embeddings(
            folder,
            directory,
            store,
            save_every=max(1, save_every),
            progress=False,
            keep=_Owns(shard, shards),
            first_id=plan.get("first_id") if plan else None,
            check_keys=False,  # build_sharded checked them once for every shard
        )
    return {"shard": shard, **report.__dict__}


def run_locally(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run `build_shard(**job)` for every job in local processes (spawned: no state
    inherited), at most one per job and per CPU; FAISS threads are shared out."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    threads = max(1, (os.cpu_count() or 1) // workers)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, context, initializer=_set_threads, initargs=(threads, os.getpid())
    ) as pool:
        futures = [pool.submit(build_shard, **job) for job in jobs]
        try:
            return [future.result() for future in futures]
        except BrokenProcessPool as exc:
            raise StoreError(
                f"a shard's build process ended abruptly ({exc}); run the same command "
                "again to resume the build"
            ) from None
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _set_threads(threads: int, parent: int) -> None:
    _die_with_parent(parent)
    faiss.omp_set_num_threads(threads)


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this worker when the build process that spawned it dies.

    A build killed with SIGKILL cannot stop its workers, which would go on writing the
    shards that the re-run resumes (two writers on one store). Elsewhere this does
    nothing: the workers then end at their next save when the pool's pipe breaks."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect (compared with
        os._exit(1)  # its pid, not with 1: the build may itself be pid 1 in a container)


def build_sharded(
    embeddings: str | os.PathLike[str],
    out: str | os.PathLike[str],
    model: str | os.PathLike[str],
    factory: str | None,
    shards: int,
    save_every: int,
    run_shards: RunShards | None = None,
) -> dict[str, Any]:
    """Build the sharded index `out` (`shards` shards) from the embeddings folder, or
    resume or extend it; returns the build's report (totals and each shard's).

    `factory` is a FAISS factory string (an existing index keeps its own: None or
    "auto" take it; a new index needs one, "auto" resolved by the caller). `model`
    made the embeddings (checked by the caller, as for an unsharded build); shard 0
    keeps its copy. `run_shards` runs a list of build_shard keyword arguments
    and returns their results in order (default: `run_locally`). Refused (StoreError):
    fewer than 1 shard, an unsharded index or anything else in `out`, an index or an
    unfinished build with another shard count, model, factory or embeddings folder.
    """
    started = time.perf_counter()
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise StoreError(f"--shards must be at least 1, got {shards!r}")
    folder = EmbeddingsFolder.open(embeddings)
    out = Path(out)
    committed = _check_out(out, folder, factory, shards)
    factory = committed.factory if committed else factory
    plan = _read_plan(out)
    if plan is not None:
        _check_plan(out, plan, folder, factory, shards)
        factory = plan["factory"]
        quantizer = _read_quantizer(out, plan)
    else:
        if factory in (None, "auto"):
            raise StoreError("a new sharded index needs a factory (resolve auto first)")
        check_folder_keys(folder, None, BATCH_ROWS)
        quantizer = None if committed else train_quantizer(folder, factory)
        first_id = max((s.next_id for s in _shard_manifests(out, committed)), default=0)
        plan = _write_plan(out, folder, factory, shards, quantizer, first_id)
    jobs = [
        {
            "embeddings": str(folder.folder),
            "shard_dir": str(out / shard_name(i)),
            "shard": i,
            "shards": shards,
            "model": str(model),
            "factory": factory,
            "quantizer": quantizer,
            "save_every": save_every,
        }
        for i in range(shards)
    ]
    results = (run_shards or run_locally)(jobs)
    if committed is None:
        write_shards_manifest(
            out,
            ShardsManifest(
                shards=tuple(shard_name(i) for i in range(shards)),
                dim=folder.dim,
                fingerprint=folder.fingerprint,
                factory=factory,
                created=mf.now_iso(),
            ),
        )
    # the build is committed: its plan and quantiser copy are no longer needed
    (out / PLAN_FILE).unlink(missing_ok=True)
    (out / QUANTIZER_FILE).unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    indexed = sum(r["indexed"] for r in results)
    report = {
        "total": sum(r["total"] for r in results),
        "indexed": indexed,
        "already_present": sum(r["already_present"] for r in results),
        "seconds": seconds,
        "images_per_s": indexed / seconds if seconds else 0.0,
        "index_size": sum(r["index_size"] for r in results),
        "shards": results,
    }
    atomic_write_text(out / REPORT_FILE, json.dumps(report, indent=2))
    return report


def train_quantizer(folder: EmbeddingsFolder, factory: str) -> bytes | None:
    """The trained, empty index of `factory` (faiss.serialize_index bytes), trained on
    the reservoir sample an unsharded build takes; None when `factory` needs no
    training (Flat, HNSW)."""
    template = new_faiss_index(folder.dim, factory)
    if template.is_trained:
        return None
    if not folder.count:
        raise EmbeddingsError(f"{folder.folder} holds no vectors to train {factory!r} on")
    trained = VectorIndex(template, "auto")
    trained.train(folder.sample(training_sample_size(factory), BATCH_ROWS))
    return faiss.serialize_index(trained.cpu).tobytes()


def _check_out(
    out: Path, folder: EmbeddingsFolder, factory: str | None, shards: int
) -> ShardsManifest | None:
    """The committed sharded index in `out` (None for a new one), once it fits."""
    if is_sharded(out):
        committed = read_shards_manifest(out)
        if len(committed.shards) != shards:
            raise StoreError(
                f"{out} is an index of {len(committed.shards)} shards, not {shards}: keep "
                f"--shards {len(committed.shards)}, or build into a new folder"
            )
        if committed.fingerprint != folder.fingerprint or committed.dim != folder.dim:
            raise StoreError(
                f"{out} was built with model fingerprint {committed.fingerprint}, but "
                f"{folder.folder} was embedded with {folder.fingerprint}: build into a new folder"
            )
        if factory not in (None, "auto") and factory != committed.factory:
            raise StoreError(f"{out} was built with factory {committed.factory!r}, not {factory!r}")
        return committed
    if (out / mf.MANIFEST).exists():
        raise StoreError(
            f"{out} is an index of one store, not a sharded one: build the sharded index "
            "into a new folder"
        )
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out} exists and is not a folder")
    ours = {PLAN_FILE, QUANTIZER_FILE, REPORT_FILE}
    others = [
        p.name
        for p in (out.iterdir() if out.is_dir() else [])
        if p.name not in ours and not p.name.startswith(SHARD_PREFIX)
    ]
    if not others and out.is_dir() and any(out.iterdir()) and not (out / PLAN_FILE).exists():
        others = ["shard folders but no build plan"]
    if others:
        raise StoreError(
            f"{out} is not empty and not a sharded index (it holds {', '.join(sorted(others))}): "
            "build into a new or empty folder"
        )
    return None


def _shard_manifests(out: Path, committed: ShardsManifest | None) -> list[mf.Manifest]:
    if committed is None:
        return []
    return [mf.read_manifest(out / name) for name in committed.shards]


def _read_plan(out: Path) -> dict[str, Any] | None:
    path = out / PLAN_FILE
    try:
        plan = parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StoreError(f"{path} is damaged ({exc}): delete {out} and build again") from None
    if not isinstance(plan, dict):
        raise StoreError(f"{path} is damaged: delete {out} and build again")
    return plan


def _write_plan(
    out: Path,
    folder: EmbeddingsFolder,
    factory: str,
    shards: int,
    quantizer: bytes | None,
    first_id: int,
) -> dict[str, Any]:
    entry = None
    if quantizer is not None:
        atomic_write_bytes(out / QUANTIZER_FILE, quantizer)
        entry = mf.sha256_file(out / QUANTIZER_FILE).to_json()
    plan = {
        "shards": shards,
        "factory": factory,
        "model_fingerprint": folder.fingerprint,
        "dim": folder.dim,
        "embeddings": str(folder.folder.resolve()),
        "first_id": first_id,
        "quantizer": entry,
    }
    atomic_write_text(out / PLAN_FILE, json.dumps(plan, indent=2) + "\n")
    return plan


def _check_plan(
    out: Path, plan: dict[str, Any], folder: EmbeddingsFolder, factory: str | None, shards: int
) -> None:
    """A re-run resumes the unfinished build only with what it started with."""
    theirs = {
        "shards": plan.get("shards"),
        "model_fingerprint": plan.get("model_fingerprint"),
        "embeddings": plan.get("embeddings"),
    }
    ours = {
        "shards": shards,
        "model_fingerprint": folder.fingerprint,
        "embeddings": str(folder.folder.resolve()),
    }
    if factory not in (None, "auto"):
        theirs["factory"], ours["factory"] = plan.get("factory"), factory
    differ = [
        f"{name} {theirs[name]!r} (not {ours[name]!r})"
        for name in ours
        if theirs[name] != ours[name]
    ]
    if differ:
        raise StoreError(
            f"{out} holds an unfinished sharded build with {'; '.join(differ)}: re-run it "
            "as it was started to resume it, or build into a new folder"
        )


def _read_quantizer(out: Path, plan: dict[str, Any]) -> bytes | None:
    entry = plan.get("quantizer")
    if entry is None:
        return None
    try:
        checksum = mf.FileEntry(str(entry["sha256"]), int(entry["bytes"]))
    except (KeyError, TypeError, ValueError):
        raise StoreError(f"{out / PLAN_FILE} is damaged: delete {out} and build again") from None
    return mf.read_verified(out, QUANTIZER_FILE, checksum)


__all__ = ["build_shard", "build_sharded", "run_locally", "train_quantizer"]
