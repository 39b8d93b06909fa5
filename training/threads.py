"""`--threads`: how many CPU threads torch runs a training command's math on.

torch's default is one intra-op thread per core, and OpenMP threads that spin while
they wait for each other. On a small host shared with other work that default is the
slowest choice: a thread the scheduler preempts holds every other one at the next
barrier, and the spinning ones take the CPU from the one that has work. On a 2-core
AMD EPYC, two epochs of `fit` on digits took twice as long with torch's 2 threads as
with 1 (docs/benchmarks.md, "Training threads"), with the same metrics.

`auto` therefore leaves a core to each data-loading worker process (torch runs each
worker's own ops on 1 thread) and one for the rest of the machine, and gives the
training process the cores left, at least 1 and at most MAX_AUTO_THREADS.

This module imports torch only in `apply_threads`: the flag parses without it.
"""

from __future__ import annotations

import logging
import os

THREADS_AUTO = "auto"
MAX_AUTO_THREADS = 8
"""`auto` never asks for more: the small models trained here stop gaining well before."""

logger = logging.getLogger("vitrieval.train")


class ThreadsError(ValueError):
    """A `--threads` value that is neither `auto` nor an integer >= 1."""


def parse_threads(value: object) -> int | None:
    """`--threads VALUE` as a thread count, None for `auto`; ThreadsError otherwise."""
    text = str(value).strip()
    if text == THREADS_AUTO:
        return None
    try:
        number = int(text)
    except ValueError:
        raise ThreadsError(
            f"--threads must be {THREADS_AUTO} or an integer >= 1, got {value!r}"
        ) from None
    if number < 1:
        raise ThreadsError(f"--threads must be {THREADS_AUTO} or an integer >= 1, got {number}")
    return number


def normal_threads(value: object) -> object:
    """`--threads` as a config holds it: an integer text as the int (a flag's "2" and
    config.yaml's 2 are the same config), anything else as given, for resolving to
    accept (`auto`) or refuse."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return value
    return value


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def auto_threads(cores: int, workers: int) -> int:
    """`--threads auto` on `cores` cores with `workers` data-loading processes: a core per
    worker and one spare, the rest (1 to MAX_AUTO_THREADS) for the training process."""
    return max(1, min(cores - workers - 1, MAX_AUTO_THREADS))


def resolve_threads(value: object, workers: int, cores: int | None = None) -> int:
    """The thread count `--threads VALUE` means with `workers` loader processes."""
    number = parse_threads(value)
    if number is not None:
        return number
    return auto_threads(usable_cores() if cores is None else cores, workers)


def apply_threads(threads: int) -> None:
    """Run torch's intra-op work on `threads` threads and its inter-op work on one (the
    training loop forks no parallel ops). Called before the model is built; the inter-op
    count can be set only once per process, so a second run in it keeps the first's.

    The DataLoader's worker processes need nothing here: torch sets each to 1 thread.
    """
    import torch

    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # inter-op work already ran in this process (tests, recipes)
            logger.debug("inter-op threads stay at %d", torch.get_num_interop_threads())
