"""LaCViT against plain cross-entropy training on digits: the table of docs/experiments.md.

For every seed, trains `fit --method ce` and `fit --method lacvit` with the same
encoder, data stream and epochs, then prints (and writes to OUT/table.md and
OUT/summary.json) the mean and sample standard deviation over seeds of the held-out
top-1 accuracy, the encoder's leave-one-out R@1 and mAP, and the isotropy score of the
encoder's embeddings before and after training. With --analyze-to DIR, also runs
`vitrieval-train analyze` on the first seed: the initial encoder, the CE encoder and the
LaCViT encoder side by side (DIR/lacvit_similarity.png, DIR/lacvit_projection.png,
DIR/lacvit_analysis.json).

Runs whose RUN/results.json exists are reused, so an interrupted experiment continues
where it stopped. Each run's wall time and CPU time (user + system, of the training
process) are recorded: the machine is shared, so wall time varies; CPU time less so.

    nice -n 10 .venv/bin/python bench/lacvit_experiment.py --out runs/lacvit \\
        --seeds 0 1 2 --epochs 8 --probe-epochs 5 --analyze-to docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_model  # bench/machine.py (scripts run from bench/)

METHODS = ("ce", "lacvit")
COLUMNS = (
    ("top1", "top-1"),
    ("recall@1", "R@1"),
    ("map", "mAP"),
    ("initial_isotropy", "isotropy before"),
    ("isotropy", "isotropy after"),
)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(method: str, seed: int, args: argparse.Namespace) -> dict:
    """One `vitrieval-train fit` run in a child process; returns its results.json + timings."""
    run = Path(args.out) / f"{method}-s{seed}"
    results_file = run / "results.json"
    if results_file.is_file():
        print(f"{run}: done before, reusing its results")
        return json.loads(results_file.read_text())
    if run.exists():
        shutil.rmtree(run)  # a run that never finished: start it again
    command = [
        sys.executable,
        "-m",
        "vitrieval.training.cli",
        "fit",
        "--method",
        method,
        "--dataset",
        "digits",
        "--preset",
        args.preset,
        "--dim",
        str(args.dim),
        "--epochs",
        str(args.epochs),
        "--probe-epochs",
        str(args.probe_epochs),
        "--seed",
        str(seed),
        "--out",
        str(run),
    ]
    print(" ".join(command[2:]), flush=True)
    cpu_before, started = _cpu_seconds(), time.perf_counter()
    subprocess.run(command, check=True)
    results = json.loads(results_file.read_text())
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    results["cpu_seconds"] = round(_cpu_seconds() - cpu_before, 1)
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    return results


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def table(runs: dict[str, list[dict]]) -> str:
    head = ["method", *(label for _, label in COLUMNS), "CPU s / run", "wall s / run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, results in runs.items():
        cells = [method]
        for key, _ in COLUMNS:
            cells.append(_mean_std([float(r[key]) for r in results]))
        for key in ("cpu_seconds", "wall_seconds"):
            values = [r[key] for r in results if key in r]
            cells.append(f"{statistics.mean(values):.0f}" if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def analyze(args: argparse.Namespace, seed: int) -> None:
    out = Path(args.out)
    scratch = out / "analysis"
    command = [
        sys.executable,
        "-m",
        "vitrieval.training.cli",
        "analyze",
        "--model",
        str(out / f"lacvit-s{seed}" / "initial.safetensors"),
        "--model",
        str(out / f"ce-s{seed}"),
        "--model",
        str(out / f"lacvit-s{seed}"),
        "--names",
        f"initial (seed {seed}),CE,LaCViT",
        "--out",
        str(scratch),
    ]
    print(" ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)
    target = Path(args.analyze_to)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("similarity.png", "projection.png", "analysis.json"):
        shutil.copyfile(scratch / name, target / f"lacvit_{name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the runs and the table")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=8, help="CE epochs = LaCViT stage 1")
    parser.add_argument("--probe-epochs", type=int, default=5, help="LaCViT stage 2")
    parser.add_argument("--analyze-to", help="copy the first seed's analysis PNGs here")
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for seed in args.seeds:
        for method in METHODS:
            runs[method].append(train(method, seed, args))
    text = table(runs)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(text)
    out = Path(args.out)
    (out / "table.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(runs, indent=2) + "\n")
    if args.analyze_to:
        analyze(args, args.seeds[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
