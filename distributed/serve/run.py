"""`vitrieval-serve --ray ADDRESS`: the application built, deployed on the cluster and
kept up until the command is stopped (SIGINT or SIGTERM)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.shards import is_sharded, open_index, shard_name
from vitrieval.index.shards.layout import read_shards_manifest
from vitrieval.service.settings import Settings
from vitrieval.service.state import StartupError

from ..cluster import ClusterError, largest_node_cpus, plan_actors, ray_cluster
from .ingress import Ingress
from .options import (
    APP_NAME,
    DEFAULT_INGRESS_REPLICAS,
    EMBED_QUEUE_FACTOR,
    EMBEDDER,
    INGRESS,
    INGRESS_HEADROOM,
    PROXY_TIMEOUT_MARGIN_S,
    SHARD_MAX_ONGOING,
)
from .replicas import EmbedderReplica, ShardReplica


@dataclass(frozen=True)
class Layout:
    """The served index as shard folders, and the model's identity."""

    shards: list[Path]
    fingerprint: str | None
    dim: int
    items: int


def check_inputs(settings: Settings) -> Layout:
    """The model and index opened once here, so a wrong path or a mismatched index is one
    line before anything is deployed (StartupError)."""
    from vitrieval.index.store import StoreError

    if settings.model is None or settings.index is None:
        raise StartupError("both a model (--model) and an index (--index) are needed")
    try:
        meta = read_model_metadata(settings.model)
    except Exception as exc:  # ModelMetadataError, OSError, ONNX's own types
        raise StartupError(f"cannot load model {settings.model}: {exc}") from None
    index = Path(settings.index)
    try:
        with open_index(index, fingerprint=meta.fingerprint, dim=meta.embedding_dim) as store:
            items = len(store)
        if is_sharded(index):
            count = len(read_shards_manifest(index).shards)
            shards = [index / shard_name(i) for i in range(count)]
        else:
            shards = [index]
    except (StoreError, OSError) as exc:
        raise StartupError(f"cannot open index {settings.index}: {exc}") from None
    return Layout(shards, meta.fingerprint, meta.embedding_dim, items)


def build_application(
    settings: Settings,
    layout: Layout,
    *,
    embed_replicas: int,
    shard_replicas: int,
    ingress_replicas: int = DEFAULT_INGRESS_REPLICAS,
    cluster: dict[str, float],
    node_cpus: int,
) -> Application:
    """The ingress bound to one embedder deployment and one deployment per shard.

    Embedder replicas are placed as `vitrieval.distributed.cluster.plan_actors` places embedding
    actors: one GPU each when the cluster has GPUs (and --device allows), else T CPUs
    each (ONNX Runtime on T threads). Shard replicas and the ingress reserve no CPU: they
    wait on memory-mapped segments and on the network, and a FAISS search is short.
    `shard_replicas` and `ingress_replicas` apply read-only; with mutations on each is
    one whatever is asked (the CLI refuses more before it gets here)."""
    plan = plan_actors(
        cluster.get("CPU", 1),
        cluster.get("GPU", 0),
        node_cpus,
        device="auto" if settings.device == "auto" else settings.device.split(":")[0],
        actors=embed_replicas,
        threads=settings.intra_op_threads,
    )
    # Serve waits without end for replicas the cluster cannot place: refuse instead
    need, kind = (embed_replicas, "GPU") if plan.gpu else (embed_replicas * plan.threads, "CPU")
    if need > cluster.get(kind, 0):
        raise ClusterError(
            f"--embed-replicas {embed_replicas} needs {need} {kind}s "
            f"({plan.describe()}), the cluster has {cluster.get(kind, 0):g}"
        )
    resources: dict[str, Any] = {"num_cpus": plan.threads}
    if plan.gpu:
        resources["num_gpus"] = 1
    device = "cuda" if plan.gpu else "cpu"
    running = 2 * settings.max_batch_size  # a full batch running, the next one filling
    model = serve.deployment(
        EmbedderReplica,
        name=EMBEDDER,
        num_replicas=embed_replicas,
        ray_actor_options=resources,
        max_ongoing_requests=running,
        max_queued_requests=EMBED_QUEUE_FACTOR * settings.max_batch_size,
    ).bind(settings, device, plan.threads, layout.dim)
    # with mutations on, a shard's one replica is its writer (one journal, one lock)
    writer = None if settings.read_only else settings
    shards = [
        serve.deployment(
            ShardReplica,
            name=shard_name(n),
            num_replicas=shard_replicas if writer is None else 1,
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=SHARD_MAX_ONGOING,
        ).bind(str(folder), layout.fingerprint, layout.dim, writer)
        for n, folder in enumerate(layout.shards)
    ]
    ingress = serve.deployment(
        Ingress,
        name=INGRESS,
        # read-only: stateless, as many as the proxy's load needs; with mutations on,
        # one (it numbers new items across the shards)
        num_replicas=ingress_replicas if writer is None else 1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_HEADROOM * settings.max_concurrency,
        max_queued_requests=settings.max_concurrency,
    )
    return ingress.bind(settings, model, shards, embed_replicas)


def serve_logging() -> dict[str, Any]:
    """Serve's own logs (the controller's, the proxy's, a line per call in every replica):
    warnings only and no access log, unless the command runs with --log-level debug."""
    debug = logging.getLogger("vitrieval").isEnabledFor(logging.DEBUG)
    return {"log_level": "INFO" if debug else "WARNING", "enable_access_log": debug}


def serve_on_ray(
    settings: Settings,
    address: str,
    *,
    embed_replicas: int,
    shard_replicas: int,
    ingress_replicas: int = DEFAULT_INGRESS_REPLICAS,
) -> int:
    """Deploy the application on the cluster `address` names and serve until SIGINT or
    SIGTERM; the exit status (2 with one line on stderr when it cannot start)."""
    try:
        layout = check_inputs(settings)
    except StartupError as exc:
        print(f"vitrieval-serve: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    try:
        with ray_cluster(address) as ray:
            # after connecting: Ray's core installs its own SIGTERM handler (an abort)
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
            app = build_application(
                settings,
                layout,
                embed_replicas=embed_replicas,
                shard_replicas=shard_replicas,
                ingress_replicas=ingress_replicas,
                cluster=ray.cluster_resources(),
                node_cpus=largest_node_cpus(ray),
            )
            running = serve.status()
            if running.proxies or running.applications:
                # Serve's HTTP options are the cluster's: ours would be ignored
                raise ClusterError(
                    "Ray Serve already runs on this cluster (its HTTP host and port are "
                    "fixed while it runs): stop it with `serve shutdown`, or serve on "
                    "another cluster"
                )
            serve.start(
                logging_config=serve_logging(),
                http_options={
                    "host": settings.host,
                    "port": settings.port,
                    "request_timeout_s": settings.request_timeout_s + PROXY_TIMEOUT_MARGIN_S,
                },
            )
            try:
                return _run_until_stopped(app, settings, layout, stop)
            finally:
                serve.shutdown()
    except ClusterError as exc:
        print(f"vitrieval-serve: {exc}", file=sys.stderr)
        return 2


def _run_until_stopped(
    app: Application, settings: Settings, layout: Layout, stop: threading.Event
) -> int:
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config=serve_logging())
    except Exception as exc:  # a replica's constructor failed (Serve retried it)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"vitrieval-serve: the application did not start: {reason}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "") else settings.host
    print(
        f"vitrieval-serve: {layout.items} items in {len(layout.shards)} shard(s) on Ray "
        f"Serve; web page http://{host}:{settings.port}/ , API docs /docs",
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    return 0
