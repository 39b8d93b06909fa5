"""`vitrieval-index build --embeddings EMB --shards N --ray ADDRESS`: each shard of a
sharded build a Ray task.

`vitrieval.index.shards.build.build_sharded` plans the build, trains the quantiser once and
commits (shards.json last) on the driver, as without Ray; it hands the shards' jobs to
a `run_shards`. The one here (`shard_runner`) runs `build_shard` once per shard as a
`ray.remote` task on the cluster `--ray` names, instead of a local process each: the
same function with the same arguments, so the shards are the ones a local build makes.

Each task reserves T of Ray's CPUs and runs FAISS on T threads, T = the cluster's CPUs
// shards (at least 1, at most the largest node's CPUs), as the local build shares out
one machine's cores. The trained quantiser is put in the object store once and shared
by every task. A task reads the whole embeddings folder and writes its shard folder
in `--out`: on a cluster of several machines, both must be on storage every node sees
at the same path. Resuming is the local build's: a killed driver takes its tasks with
it (Ray ends a dead driver's workers), and the same command again carries on each
shard from its last save.
"""

from __future__ import annotations

from typing import Any

from vitrieval.index.shards.build import RunShards, build_shard

from .cluster import ClusterError, import_ray, largest_node_cpus, parse_address, ray_cluster


def shard_runner(address: str) -> RunShards:
    """A `run_shards` for `build_sharded` that runs every shard as a Ray task on the
    cluster `address` names (checked now: a bad address or no Ray fails before the build
    starts)."""
    address = parse_address(address)
    import_ray()

    def run_shards(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with ray_cluster(address) as ray:
            cpus = int(ray.cluster_resources().get("CPU", 1))
            threads = max(1, min(cpus // max(1, len(jobs)), largest_node_cpus(ray)))
            # no retries: a retry beside a worker that lost touch with the cluster but
            # still runs would be two writers on one shard; the re-run resumes instead
            task = ray.remote(num_cpus=threads, max_retries=0)(_build_shard_task)
            quantizers: dict[int, Any] = {}  # one object per distinct quantiser (one)
            refs = []
            for job in jobs:
                quantizer = job["quantizer"]
                if id(quantizer) not in quantizers:
                    quantizers[id(quantizer)] = ray.put(quantizer)
                rest = {key: value for key, value in job.items() if key != "quantizer"}
                refs.append(task.remote(threads, quantizers[id(quantizer)], rest))
            try:
                return ray.get(refs)
            except ray.exceptions.RayTaskError as exc:
                # the shard's own error (StoreError, EmbeddingsError...): one line
                raise exc.cause if isinstance(exc.cause, Exception) else exc from None
            except ray.exceptions.RayError as exc:
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                reason = lines[-1] if lines else type(exc).__name__
                raise ClusterError(
                    f"a shard's build task failed: {reason}; run the same command again to "
                    "resume the build"
                ) from None

    return run_shards


def _build_shard_task(threads: int, quantizer: bytes | None, job: dict[str, Any]) -> dict:
    """`build_shard(**job)` in a Ray worker, FAISS on the `threads` CPUs it reserved."""
    import faiss

    faiss.omp_set_num_threads(threads)
    return build_shard(**{**job, "quantizer": quantizer})
