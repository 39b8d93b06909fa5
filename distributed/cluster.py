"""The Ray cluster a `--ray ADDRESS` option names: the address checked, the cluster
started or joined for one command, and left at its end.

ADDRESS is one of

- `local`: a Ray cluster started for this command on this machine (every CPU and GPU
  it has, no dashboard), shut down when the command ends;
- `auto`: the cluster already running here (`ray start --head` on this machine, or
  the one the RAY_ADDRESS variable names), joined as a driver and left at the end;
- `ray://HOST:PORT`: a remote cluster's Ray Client address (port 10001 by default),
  the driver on this machine and the work on the cluster.

Every `--ray` option goes through `parse_address` and `ray_cluster`. Without Ray
installed, either ends in a `ClusterError` (a ValueError: the CLI prints one line and
exits 2) naming the extra that installs it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

LOCAL = "local"
AUTO = "auto"
DEFAULT_ACTOR_THREADS = 4
"""Threads per CPU actor at most, by default: ONNX Runtime's ViT kernels scale well to
about 4 threads; past that, more actors of 4 threads embed more images per second
than fewer, wider ones."""
RAY_EXTRA = "pip install -c constraints.txt -e '.[distributed]'"
"""The install that adds Ray, from the vitrieval checkout: the constraints pin the Ray
version the project is tested with (a newer Ray may have removed what it calls)."""
ADDRESS_HELP = (
    "run on a Ray cluster: 'local' (start one on this machine for this command), "
    "'auto' (join the running cluster) or ray://HOST:PORT (a remote cluster's client "
    f"address); needs {RAY_EXTRA}"
)
_CLIENT = re.compile(r"ray://(?P<host>[^\s:/]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})/?")


class ClusterError(ValueError):
    """A --ray address that is not one, Ray missing, or a cluster that cannot be joined."""


def parse_address(text: str) -> str:
    """`text` checked as a --ray ADDRESS (see the module docstring), returned as given."""
    if text in (LOCAL, AUTO):
        return text
    match = _CLIENT.fullmatch(text)
    if match and 0 < int(match.group("port")) < 65536:
        return text
    raise ClusterError(
        f"--ray {text!r} is not a Ray address: use 'local' (a cluster for this command), "
        "'auto' (the running cluster) or ray://HOST:PORT (a remote cluster)"
    )


def import_ray() -> ModuleType:
    """The `ray` module, or a ClusterError naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ClusterError(f"--ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


@contextmanager
def ray_cluster(address: str) -> Iterator[ModuleType]:
    """Connected to the cluster `address` names for the duration of the block: the `ray`
    module. A local cluster is started here and shut down at the end; a joined one is
    only disconnected from. A process already connected (a test session's cluster, a
    notebook) keeps its connection, and the block runs on that cluster."""
    address = parse_address(address)
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    # Ray's own lines (the cluster started, token authentication) and the workers'
    # output are not the command's: it prints its summary, and actors' errors come back
    # as exceptions. -v shows them.
    quiet: dict[str, Any] = {"logging_level": ray_log_level(), "log_to_driver": _verbose()}
    try:
        if address == LOCAL:
            # address="local", not None: with no address, Ray joins a cluster a
            # `ray start` left running or RAY_ADDRESS names instead of starting one
            ray.init(address=LOCAL, include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, grpc errors...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterError(
            f"--ray {address}: cannot start or join the cluster ({reason})"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _verbose() -> bool:
    return logging.getLogger("vitrieval").isEnabledFor(logging.INFO)


def ray_log_level() -> int:
    """The level of Ray's loggers: errors only, unless the command runs with -v."""
    return logging.INFO if _verbose() else logging.ERROR


def largest_node_cpus(ray: ModuleType) -> int:
    """The CPUs of the cluster's largest live node: more threads than that for one
    actor could never be scheduled."""
    cpus = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")]
    return max(1, int(max(cpus, default=1)))


@dataclass(frozen=True)
class ActorPlan:
    """How many actors, with how many threads each, and whether each holds a GPU."""

    actors: int
    threads: int
    gpu: bool

    def describe(self) -> str:
        where = "1 GPU and " if self.gpu else ""
        return f"{self.actors} actor(s), each with {where}{self.threads} thread(s)"


def plan_actors(
    cpus: float,
    gpus: float,
    node_cpus: int,
    *,
    device: str = "auto",
    actors: int | None = None,
    threads: int | None = None,
) -> ActorPlan:
    """The actor pool for a cluster of `cpus` CPUs and `gpus` GPUs whose largest node
    has `node_cpus` CPUs (the rule is in `vitrieval.distributed.embed`)."""
    for flag, value in (("--actors", actors), ("--actor-threads", threads)):
        if value is not None and value < 1:
            raise ClusterError(f"{flag} must be at least 1, got {value}")
    cpus_int, gpus_int = max(1, int(cpus)), int(gpus)
    if device == "cuda" and gpus_int < 1:
        raise ClusterError("--device cuda: the Ray cluster has no GPU")
    gpu = gpus_int >= 1 and device in ("auto", "cuda")
    if gpu:
        actors = actors or gpus_int
        threads = threads or min(DEFAULT_ACTOR_THREADS, cpus_int // actors)
    else:
        if threads is None:
            threads = cpus_int // actors if actors else DEFAULT_ACTOR_THREADS
        actors = actors or max(1, cpus_int // min(max(1, threads), node_cpus))
    return ActorPlan(actors=actors, threads=max(1, min(threads, node_cpus)), gpu=gpu)
