"""Saying once per process that a library runs on the CPU for want of a GPU.

ONNX Runtime (the embedder) and FAISS (every index segment) each find out on their
own, and a server opens many segments: without this, a CPU host's log repeats the
same news at every start and every reload. A caller that knows both reasons up front
(the service) names them in one line; the later calls for those libraries are then
silent.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("vitrieval.devices")

_lock = threading.Lock()
_said: set[str] = set()


def claim_cpu_only(reasons: dict[str, str]) -> dict[str, str]:
    """Mark the libraries of `reasons` ({library: reason}) as named, so that their own
    later calls stay silent; returns the ones not named before, for `say_cpu_only`."""
    with _lock:
        new = {library: why for library, why in reasons.items() if library not in _said}
        _said.update(new)
    return new


def log_cpu_only(reasons: dict[str, str]) -> None:
    """The one INFO line for `reasons` (claimed already; nothing when empty)."""
    if reasons:
        parts = "; ".join(f"{library}: {why}" for library, why in reasons.items())
        logger.info("no GPU in use (%s): running on the CPU", parts)


def say_cpu_only(reasons: dict[str, str]) -> None:
    """Log at INFO, in one line, why each library of `reasons` ({library: reason})
    runs on the CPU, leaving out the libraries this process has already named."""
    log_cpu_only(claim_cpu_only(reasons))
