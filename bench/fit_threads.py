"""Training speed per `--threads` setting: the same short `fit` on digits, alternating.

Each round runs `vitrieval-train fit --dataset digits --preset tiny --epochs E` once per
candidate, in a fresh process each (torch fixes its thread pools in the first one that
uses them), in turn, so the machine's load drifts across all of them alike. A candidate
is `LABEL=THREADS[+passive]`: `--threads THREADS`, and with `+passive` OpenMP told to
sleep instead of spin while it waits (OMP_WAIT_POLICY=PASSIVE). Prints each run's
seconds per epoch (metrics.jsonl's `train_seconds`) and wall time, then the medians side
by side with their ratio to the first candidate, and whether the runs' metrics agree.

    python bench/fit_threads.py [--epochs 2] [--rounds 2] [--busy N]
        [--candidates 'torch default=2,auto=auto,2 passive=2+passive']

`--busy N` adds N processes spinning on the CPU for the whole bench: the loaded host
of a CI runner shared with other jobs, reproducible.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import REPO, cpu_model, git, load_average

DEFAULT_CANDIDATES = "torch default=2,auto=auto,2 passive=2+passive"


def spin() -> None:
    while True:
        pass


def parse_candidates(text: str) -> list[tuple[str, str, bool]]:
    """'LABEL=THREADS[+passive],...' -> [(label, threads, passive)]."""
    found = []
    for part in text.split(","):
        label, _, value = part.partition("=")
        threads, _, policy = value.partition("+")
        found.append((label.strip(), threads.strip(), policy.strip() == "passive"))
    return found


def run_fit(threads: str, passive: bool, epochs: int) -> dict:
    """One `fit` in a fresh process: its epochs' train seconds, wall time, metrics."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env.pop("OMP_WAIT_POLICY", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "vitrieval.training.cli", "fit", "--dataset", "digits"]
        command += ["--preset", "tiny", "--epochs", str(epochs), "--threads", threads]
        command += ["--out", str(out)]
        load = load_average().split()[0]
        started = time.perf_counter()
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
        wall = time.perf_counter() - started
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        used = yaml.safe_load((out / "config.yaml").read_text())
    return {
        "epoch_s": [row["train_seconds"] for row in rows],
        "wall": wall,
        "load": f"{load}->{load_average().split()[0]}",
        "metrics": [(row["loss"], row["recall@1"], row["map"]) for row in rows],
        "threads": used["threads"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="CPU-spinning processes beside")
    parser.add_argument("--candidates", default=DEFAULT_CANDIDATES)
    args = parser.parse_args()
    candidates = parse_candidates(args.candidates)
    print(
        f"{cpu_model()}, {os.cpu_count()} cores, commit {git('rev-parse', '--short', 'HEAD')}, "
        f"load average {load_average()}, {args.busy} spinning processes beside"
    )
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for hog in hogs:
        hog.start()
    results: dict[str, list[dict]] = {label: [] for label, _, _ in candidates}
    try:
        for round_ in range(1, args.rounds + 1):
            for label, threads, passive in candidates:
                done = run_fit(threads, passive, args.epochs)
                results[label].append(done)
                epochs = " ".join(f"{s:.1f}" for s in done["epoch_s"])
                print(
                    f"round {round_} {label:>14}: threads {done['threads']}, epochs {epochs} s, "
                    f"wall {done['wall']:.1f} s, load {done['load']}",
                    flush=True,
                )
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"\nload average after: {load_average()}")
    first = None
    print(f"| setting | threads | s/epoch (median) | vs {candidates[0][0]} | wall s (median) |")
    print("|---|---:|---:|---:|---:|")
    for label, _, passive in candidates:
        runs = results[label]
        per_epoch = statistics.median(s for run in runs for s in run["epoch_s"])
        wall = statistics.median(run["wall"] for run in runs)
        first = first or per_epoch
        name = label + (" (OMP_WAIT_POLICY=PASSIVE)" if passive else "")
        print(
            f"| {name} | {runs[0]['threads']} | {per_epoch:.2f} | {per_epoch / first:.2f}x "
            f"| {wall:.1f} |"
        )
    by_threads: dict[int, set] = {}
    for runs in results.values():
        for run in runs:
            by_threads.setdefault(run["threads"], set()).add(repr(run["metrics"]))
    for threads, variants in sorted(by_threads.items()):
        same = "identical" if len(variants) == 1 else f"{len(variants)} different"
        print(f"metrics of the runs with {threads} thread(s): {same}; (loss, R@1, mAP) per epoch:")
        for variant in sorted(variants):
            print(f"  {variant}")


if __name__ == "__main__":
    main()
