"""What a training run says about time: the line printed while it starts up, the
elapsed time and an estimate of the time left on every epoch line, and the one line a
finished run gives when asked to resume with nothing left to do.

A run on a shared CPU may spend a minute before its first epoch ends and half a minute
or more on each one; without these a user cannot tell a slow run from a stuck one.
This module imports no torch: the command line prints its first line before the
training libraries are imported (which alone takes seconds).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def clock(seconds: float) -> str:
    """`seconds` as M:SS, or H:MM:SS from an hour on."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class EpochClock:
    """Elapsed time since the first epoch this process trains, and the time left at the
    mean pace of the epochs done so far (training and evaluation both)."""

    def __init__(self, done: int, epochs: int) -> None:
        self.first_done = done  # epochs finished before this process started (resume)
        self.epochs = epochs
        self.started = time.perf_counter()

    def text(self, epoch: int) -> str:
        """After `epoch` ends: "elapsed M:SS, about M:SS left" ("elapsed M:SS" at the end)."""
        elapsed = time.perf_counter() - self.started
        trained = max(epoch - self.first_done, 1)
        left = self.epochs - epoch
        if left <= 0:
            return f"elapsed {clock(elapsed)}"
        return f"elapsed {clock(elapsed)}, about {clock(elapsed / trained * left)} left"


def preparing_line(command: str, cfg: object, resume: bool) -> str:
    """The first line of `fit` or `pretrain`: what happens before the first epoch."""
    out = getattr(cfg, "out", "")
    if resume:
        return f"{command}: resuming {out}: loading torch, the checkpoint and the images ..."
    data = getattr(cfg, "dataset", None) or getattr(cfg, "images", "")
    return (
        f"{command}: preparing {out}: loading torch, the {data} images (decoding and "
        f"checking each) and the {getattr(cfg, 'backbone', '')} model ..."
    )


def finished_line(run: Path, done: int, epochs: int, last: dict | None) -> str:
    """A run asked to resume with its `epochs` already trained (`done` of them)."""
    from .run_folder import show_metric

    scores = ""
    if last and "recall@1" in last:
        scores = (
            f", held-out R@1 {show_metric(last['recall@1'])} mAP {show_metric(last['map'])}"
            f" MAP@R {show_metric(last.get('map_at_r'))}"
        )
    elif last and last.get("loss") is not None:
        scores = f", loss {last['loss']:.4f}"
    return (
        f"{run}: already finished, {done} of {epochs} epochs{scores}; nothing left to do "
        f"(--epochs above {done} trains longer)"
    )


def line_buffered() -> None:
    """Every line of the run reaches a pipe when it is printed, not at the end."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if callable(reconfigure):
        reconfigure(line_buffering=True)
