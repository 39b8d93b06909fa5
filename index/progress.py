"""Progress of the long `vitrieval-index` commands: a redrawn bar on a terminal, and on
anything else (a log file, a CI job, a pipe) one plain line now and then, since a
redrawn bar there is either invisible or thousands of carriage returns."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

LINE_INTERVAL_S = 10.0
"""Seconds between two progress lines off a terminal (the first and last always show)."""


class LineProgress:
    """`tqdm`'s update/close for a non-terminal: "DESC: N of TOTAL UNIT (P%)" lines on
    stderr, the first update at once, then at most one line per `interval` seconds."""

    def __init__(
        self,
        total: int,
        unit: str,
        desc: str,
        *,
        initial: int = 0,
        interval: float = LINE_INTERVAL_S,
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.unit, self.desc, self.n = total, unit, desc, initial
        self.interval = interval
        self.stream = stream
        self._shown_at: float | None = None
        self._shown_n = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self._shown_at is None or now - self._shown_at >= self.interval:
            self._show(now)

    def close(self) -> None:
        if self.n != self._shown_n:  # the last count, unless it was just shown
            self._show(time.monotonic())

    def _show(self, now: float) -> None:
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        print(
            f"{self.desc}: {self.n:,} of {self.total:,} {self.unit}{share}",
            file=self.stream or sys.stderr,
            flush=True,
        )
        self._shown_at, self._shown_n = now, self.n


def progress_bar(
    total: int, unit: str, desc: str, *, initial: int = 0, enabled: bool = True
) -> tqdm | LineProgress:
    """A tqdm bar when stderr is a terminal, else `LineProgress`; disabled (a bar that
    shows nothing) when not `enabled`."""
    if not enabled:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, unit=unit, desc=desc, initial=initial, dynamic_ncols=True)
    return LineProgress(total, unit, desc, initial=initial)
