"""The test session's Ray cluster: ONE local cluster (2 CPUs), started by the first test
that asks for it and shut down when the session ends (conftest.py imports the fixture).

Tests that need Ray are marked `@pytest.mark.ray` and ask for `ray_address`; without
the distributed extra they skip. Their commands join this cluster with `--ray auto`
and RAY_ADDRESS set to its address (in a subprocess), or run on it in-process (a
process already connected keeps its connection, see distributed.cluster).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator

import pytest

NO_RAY = "the distributed extra is not installed"
CLUSTER_CPUS = 2


def ray_missing() -> bool:
    return importlib.util.find_spec("ray") is None


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The GCS address of the session's local Ray cluster."""
    if ray_missing():
        pytest.skip(NO_RAY)
    import ray

    ray.init(
        address="local",
        num_cpus=CLUSTER_CPUS,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        # the cluster's processes (GCS, raylet, workers) end with the driver that
        # started them
        ray.shutdown()
