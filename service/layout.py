"""How the service runs the model: dynamic batching, or model calls side by side.

On a GPU one large call beats many small ones, so queries that arrive together are
batched. On CPUs the measurement says otherwise: ViT-S/16 at 224 px (fused INT8) on 2
cores, 16 clients, served 50.5 images/s with one model call per core side by side on
one ONNX Runtime thread each, against 40.6 with dynamic batching on one session of 2
threads and 42.3 with one call at a time (docs/benchmarks.md, "ViT-S/16 at 224 px
served"). Settings given explicitly always win over these defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .settings import Settings


@dataclass(frozen=True)
class ModelLayout:
    batching: bool
    concurrent_calls: int  # model calls at once when not batching
    intra_op_threads: int | None  # ONNX Runtime threads per call (None: its default)


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def model_layout(settings: Settings, on_gpu: bool) -> ModelLayout:
    """The layout for `settings`: batching on a GPU, one single-thread call per core on
    CPUs, unless `batching`, `unbatched_concurrency` or `intra_op_threads` say otherwise."""
    batching = on_gpu if settings.batching is None else settings.batching
    if batching:
        return ModelLayout(True, 1, settings.intra_op_threads)
    calls = settings.unbatched_concurrency or (1 if on_gpu else cpu_count())
    threads = settings.intra_op_threads or (1 if calls > 1 and not on_gpu else None)
    return ModelLayout(False, calls, threads)
