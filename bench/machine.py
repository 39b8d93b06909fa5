"""The machine description every benchmark prints with its figures."""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git(*args: str) -> str:
    """`git ARGS` in the repository, its output stripped ("?" when it fails)."""
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "?"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def describe(**extra: object) -> dict[str, object]:
    """What a run's figures depend on: the CPU, cores, memory, nice level, Python, the
    commit and the load before it starts; `extra` (library versions, options) after."""
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1),
        "nice": os.nice(0),
        "python": platform.python_version(),
        "commit": git("rev-parse", "--short", "HEAD"),
        "load_before": load_average(),
        **extra,
    }


def work_directory(workdir: str | None, prefix: str, refuse: Callable[[str], NoReturn]) -> Path:
    """`--workdir` made and checked empty (`refuse` says why not, as argparse's
    `error`), or a new temporary folder named `prefix`-..."""
    import tempfile

    if workdir is None:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        refuse(f"--workdir {work} is not empty")
    return work
