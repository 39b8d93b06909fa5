"""The service's model layout: batching on a GPU, calls side by side on CPUs, settings
given explicitly always winning (service/layout.py)."""

from __future__ import annotations

import pytest

from vitrieval.service.layout import ModelLayout, cpu_count, model_layout
from vitrieval.service.settings import Settings


@pytest.mark.parametrize(
    ("given", "on_gpu", "expected"),
    [
        ({}, False, ModelLayout(False, cpu_count(), 1 if cpu_count() > 1 else None)),
        ({}, True, ModelLayout(True, 1, None)),
        ({"batching": True}, False, ModelLayout(True, 1, None)),
        ({"batching": False}, True, ModelLayout(False, 1, None)),
        ({"unbatched_concurrency": 1}, False, ModelLayout(False, 1, None)),  # one at a time
        ({"unbatched_concurrency": 3}, False, ModelLayout(False, 3, 1)),
        ({"unbatched_concurrency": 3, "intra_op_threads": 2}, False, ModelLayout(False, 3, 2)),
        ({"batching": True, "intra_op_threads": 2}, False, ModelLayout(True, 1, 2)),
    ],
)
def test_the_layout_follows_the_device_unless_set(given, on_gpu, expected) -> None:
    assert model_layout(Settings(read_only=True, **given), on_gpu) == expected
