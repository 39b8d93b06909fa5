"""`vitrieval-index embed --ray ADDRESS`: the parts of an embed done by a pool of Ray
actors, into the same embeddings folder `vitrieval.index.pipeline.embed_folder` writes.

The driver (the command's process) opens the folder with
`vitrieval.index.pipeline.embed_folder.start_job`,
exactly as the single-process embed does (same checks, same resumability: parts
recorded in embeddings.json are skipped), and hands the parts left to do, each as its
inputs (key, label, path, metadata) in JSON, one at a time to a fixed pool of
actors (`PartEmbedder`), each holding one Embedder (one
ONNX Runtime session) for its lifetime. An actor embeds a whole part with
`vitrieval.index.pipeline.embed_folder.embed_part` (the same decoding and model as the
single-process embed),
writes its Parquet file atomically and returns its row count and unreadable inputs;
the driver commits each part (errors.csv, then embeddings.json) as the results
arrive, in any order, with the same `EmbedJob.commit`. A killed driver loses the
parts in flight; a re-run embeds those only.

Parts are the unit of parallelism: a list of P parts keeps at most P actors busy
(`--part-size` sets it; the default, `vitrieval.index.pipeline.embed_folder.default_part_size`, is
16 parts of
100 to 50,000 images, the same rule as the single-process embed).

Threads per actor (T, `--actor-threads`): each actor reserves T of Ray's CPUs, runs
ONNX Runtime with T intra-op threads and decodes with T threads (decoding and the
model alternate, batch i+1 decoding while batch i runs). Ray never places more
actors on a node than its CPUs allow, so actors x T <= CPUs on every node: no node is
oversubscribed. The defaults: T = min(4, the largest node's CPUs), and `--actors`
N = the cluster's CPUs // T; with `--actors` alone, T = CPUs // N. On a cluster with
GPUs (and `--device` auto or cuda): one actor per GPU (`num_gpus=1`, the CUDA
execution provider), each with T = min(4, CPUs // GPUs) threads for decoding.

Files: the actors write the part files, the driver embeddings.json and errors.csv,
all in `--out`, and the actors read the images at the paths the list gives (relative
ones against the driver's working folder). On a cluster of several machines, `--out`
and the images must be on storage every node sees at the same path (NFS, a shared
volume); a part the driver cannot see after an actor wrote it stops the job with a
message saying so. The nodes need vitrieval installed (the actors import it) and the
model file at the same path; the driver's decoder choice (`VITRIEVAL_DECODER`) goes
to the actors with their arguments, whatever the nodes' environments say.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.pipeline.embed_folder import EmbedJob, EmbedReport, embed_part, start_job
from vitrieval.index.pipeline.embeddings_folder import EmbeddingsError, part_name
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.runtime.vips_decode import DECODER_ENV, decoder_setting

from .cluster import (
    ActorPlan,
    ClusterError,
    import_ray,
    largest_node_cpus,
    parse_address,
    plan_actors,
    ray_cluster,
)

logger = logging.getLogger("vitrieval.distributed")

ACTOR_RESTARTS = 2
"""Times an embedding actor whose process died (a node lost, a decoder crash, the
kernel's OOM killer) is started again. Unbounded (Ray Data's default), every part is
retried forever: a part that kills its actor would loop until someone noticed."""
PART_RETRIES = 2
"""Times a part whose actor died is tried again, on a restarted actor."""


class PartEmbedder:
    """One actor of the pool: an Embedder created once, then whole parts embedded and
    written, one per call (a batch of rows `part`, `inputs`)."""

    def __init__(
        self,
        model: str,
        fingerprint: str,
        out: str,
        base: str,
        device: str,
        batch_size: int,
        threads: int,
        decoder: str,
    ) -> None:
        # the driver's decoder choice: a node of a remote cluster has its own environment
        os.environ[DECODER_ENV] = decoder
        self.embedder = Embedder(
            model,
            device=device,
            batch_size=batch_size,
            decode_threads=threads,
            intra_op_threads=threads,
            # idle ORT threads spinning between batches take the cores of the other
            # actors on the node
            spin_wait=False,
        )
        if self.embedder.fingerprint != fingerprint:
            raise EmbeddingsError(
                f"{model} on this node has fingerprint {self.embedder.fingerprint[:12]}, "
                f"the driver's {fingerprint[:12]}: every node needs the same model file"
            )
        self.out = Path(out)
        self.base = Path(base)

    def embed(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The remote method: Ray actors expose named methods, not `__call__`."""
        return self(batch)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        numbers, rows, failed = [], [], []
        for number, inputs in zip(batch["part"], batch["inputs"], strict=True):
            name = part_name(int(number))
            chunk = [
                Item(
                    key=key,
                    label=label,
                    path=None if path is None else Path(path),
                    metadata=metadata,
                )
                for key, label, path, metadata in json.loads(inputs)
            ]
            # relative paths are the driver's: opened against its working folder
            read = [
                replace(item, path=self.base / item.path) if item.path else item for item in chunk
            ]
            part = embed_part(self.embedder, chunk, name, read=read)
            part.write(self.out / name)
            numbers.append(int(number))
            rows.append(part.rows)
            failed.append(json.dumps(part.failed))
        return {
            "part": np.array(numbers, np.int64),
            "rows": np.array(rows, np.int64),
            "failed": np.array(failed, dtype=object),
        }


def embed_from_args(items: Sequence[Item], out: Path, args: argparse.Namespace) -> EmbedReport:
    """`vitrieval-index embed --ray`: `embed_on_ray` with the command's options."""
    return embed_on_ray(
        items,
        out,
        Path(args.model),
        address=args.ray,
        device=args.device,
        batch_size=args.batch_size,
        part_size=args.part_size,
        source=str(args.images),
        actors=args.actors,
        threads=args.actor_threads,
    )


def embed_on_ray(
    items: Sequence[Item],
    out: Path,
    model: Path,
    *,
    address: str,
    device: str = "auto",
    batch_size: int = 64,
    part_size: int | None = None,
    source: str | None = None,
    actors: int | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> EmbedReport:
    """Embed `items` into the embeddings folder `out` on the Ray cluster `address`,
    resuming a run that stopped (whichever runner made it)."""
    address = parse_address(address)
    import_ray()  # before any work: without Ray, one line naming the extra
    # the driver's own session only checks the model and gives its fingerprint and size
    driver = Embedder(model, device="cpu", batch_size=batch_size, intra_op_threads=1)
    job = start_job(items, out, driver, part_size=part_size, source=source)
    if job.todo:
        with ray_cluster(address) as ray:
            resources = ray.cluster_resources()
            plan = plan_actors(
                resources.get("CPU", 1),
                resources.get("GPU", 0),
                largest_node_cpus(ray),
                device=device,
                actors=actors,
                threads=threads,
            )
            # more actors than parts would only start and idle
            plan = replace(plan, actors=min(plan.actors, len(job.todo)))
            logger.info("embedding %d part(s) with %s", len(job.todo), plan.describe())
            constructor = {
                "model": str(model.absolute()),
                "fingerprint": driver.fingerprint,
                "out": str(job.out.absolute()),
                "base": os.getcwd(),
                "device": "cuda" if plan.gpu else "cpu",
                "batch_size": batch_size,
                "threads": plan.threads,
                "decoder": decoder_setting(),
            }
            _run(ray, job, plan, constructor, progress)
    return job.finish()


def _run(
    ray: ModuleType, job: EmbedJob, plan: ActorPlan, constructor: dict[str, Any], progress: bool
) -> None:
    """Embed the parts of `job.todo` on the actor pool, committing each as it returns.

    Plain Ray actors, given one part at a time each (a part queued behind another on a
    busy actor would wait while an idle actor has nothing). Ray Data's actor pool took
    the restart and retry bounds only as `ray_remote_args`, which Ray deprecates
    (removed in Ray 2.64); `ray.remote` takes them as named options."""
    worker = ray.remote(
        num_cpus=plan.threads,
        num_gpus=1 if plan.gpu else 0,
        max_restarts=ACTOR_RESTARTS,
        max_task_retries=PART_RETRIES,
    )(PartEmbedder)
    actors = [worker.remote(**constructor) for _ in range(plan.actors)]
    waiting = list(job.todo)
    running: dict[Any, Any] = {}  # the result of a part -> the actor embedding it
    bar = job.progress_bar(progress)
    try:
        while waiting or running:
            while waiting and len(running) < len(actors):
                busy = list(running.values())
                actor = next(a for a in actors if not any(a is b for b in busy))
                running[actor.embed.remote(_part_batch(job, waiting.pop(0)))] = actor
            (ready,), _ = ray.wait(list(running), num_returns=1)
            del running[ready]
            row = _result(ray, ready)
            number = int(row["part"][0])
            name = part_name(number)
            if not (job.out / name).is_file():
                raise ClusterError(
                    f"an actor wrote {name}, but {job.out} here does not hold it: on a "
                    "cluster of several machines, --out must be on storage every node shares"
                )
            job.commit(number, int(row["rows"][0]), json.loads(row["failed"][0]))
            start, stop = job.ranges[number]
            bar.update(stop - start)
    except KeyboardInterrupt:
        raise job.stopped() from None  # the committed parts are kept; the stop line says so
    finally:
        bar.close()
        for actor in actors:
            ray.kill(actor)


def _part_batch(job: EmbedJob, number: int) -> dict[str, np.ndarray]:
    """Part `number` as the one-row batch `PartEmbedder` takes: its inputs as JSON."""
    inputs = [
        [item.key, item.label, None if item.path is None else str(item.path), item.metadata]
        for item in job.items[slice(*job.ranges[number])]
    ]
    return {
        "part": np.array([number], np.int64),
        "inputs": np.array([json.dumps(inputs)], dtype=object),
    }


def _result(ray: ModuleType, ref: Any) -> dict[str, np.ndarray]:
    """What an actor returned for a part. An error raised while embedding reaches the
    CLI as itself (one line); an actor that could not start (a model missing or
    different on its node, no GPU provider) is one line, the last of Ray's report; one
    whose process died more times than the restarts allow (`ACTOR_RESTARTS`,
    `PART_RETRIES`) is one line saying so."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise ClusterError(f"an embedding actor failed: {_last_line(exc)}") from None
    except ray.exceptions.RayError as exc:
        if isinstance(exc, ray.exceptions.ActorDiedError) and not exc.actor_init_failed:
            # max_restarts counts an actor's deaths over its life, not one part's, and
            # several parts are in flight: the message says what was exhausted
            raise ClusterError(
                f"an embedding actor's process died more than {ACTOR_RESTARTS} times "
                f"(a part is tried at most {PART_RETRIES + 1} times): out of memory, or a "
                "crash in a decoder or the model, as the node's Ray logs say; the parts done "
                "are kept and a re-run embeds the rest (if it dies the same way, try "
                "VITRIEVAL_DECODER=pillow)"
            ) from None
        raise ClusterError(f"an embedding actor failed: {_last_line(exc)}") from None


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
