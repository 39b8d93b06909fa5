"""Training-step time per pooling head, side by side in one run.

What is measured, per pooling (cls, avg, max, gem, ggem by default), on one backbone preset:

- a full training step: forward, norm-softmax loss (10 classes), zero_grad, backward,
  clip_grad_norm_(1.0) and an AdamW step over `vitrieval.training.optim.param_groups`, on one batch
  of
  random images and labels created once and shared by every pooling;
- the pooling layer alone: forward + backward on random tokens of the backbone's output shape
  (B, P + T, D) with its P prefix tokens, so the pooling's own share of the step is visible.

Every model is built from the same seed. The poolings are interleaved round-robin (round 1 runs
every pooling, then round 2 ...), each round starting with a few warm-up steps, so that noise
from other work on a shared machine spreads over all poolings alike. Reported per pooling: the
median over rounds of the mean step time in a round, and the minimum. Nothing is asserted.

GGeM's overhead is (median step of ggem - median step of avg) / median step of avg; the goal
is at most 5 % of the step.

Run:  .venv/bin/python bench/pooling_step.py [--preset small] [--markdown] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
from machine import cpu_model  # bench/machine.py (scripts run from bench/)

from vitrieval.training.backbones import PRESETS
from vitrieval.training.losses import create_loss
from vitrieval.training.model import build_model
from vitrieval.training.optim import param_groups
from vitrieval.training.pooling import pooling_names

NUM_CLASSES = 10
COLUMNS = ("pool", "median step ms", "min step ms", "img/s", "ratio vs avg")
COLUMNS += ("pool fwd+bwd ms", "pool share %")
SEED = 0


class Case:
    """One pooling: model, loss, optimiser and the pooling alone, ready to be timed."""

    def __init__(self, preset: str, pool: str, images: torch.Tensor, labels: torch.Tensor):
        torch.manual_seed(SEED)
        self.model = build_model(preset, pool)
        self.loss = create_loss("norm_softmax", self.model.embedding_dim, NUM_CLASSES)
        groups = param_groups(self.model, self.loss, 0.05, 1.0, 100.0)
        for group in groups:
            group["lr"] = 1e-4 * group["lr_scale"]
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4)
        self.images, self.labels = images, labels
        self.model.train()
        with torch.no_grad():
            shape = self.model.backbone.forward_features(images[:1]).shape
        self.prefix = self.model.num_prefix_tokens
        self.pool = copy.deepcopy(self.model.pool)
        self.tokens = torch.randn(len(images), shape[1], shape[2], requires_grad=True)

    def step(self) -> None:
        loss = self.loss(self.model(self.images), self.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def pool_fwd_bwd(self) -> None:
        self.tokens.grad = None
        self.pool.zero_grad(set_to_none=True)
        self.pool(self.tokens, self.prefix).sum().backward()


def timed(fn: Any, iterations: int, warmup: int) -> float:
    """Mean seconds per call of fn over `iterations` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--pools", default="cls,avg,max,gem,ggem", help="comma-separated names")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all numbers here")
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    unknown = [p for p in pools if p not in pooling_names()]
    if unknown or not pools:
        parser.error(f"unknown pooling {unknown}; valid: {', '.join(pooling_names())}")

    size = PRESETS[args.preset].data_overlay["input_size"]
    torch.manual_seed(SEED)
    images = torch.randn(args.batch_size, *size)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,))
    cases = {pool: Case(args.preset, pool, images, labels) for pool in pools}
    step_s: dict[str, list[float]] = {p: [] for p in pools}
    pool_s: dict[str, list[float]] = {p: [] for p in pools}
    pool_iters = 10 * args.steps
    for _ in range(args.rounds):
        for pool, case in cases.items():
            step_s[pool].append(timed(case.step, args.steps, args.warmup))
            pool_s[pool].append(timed(case.pool_fwd_bwd, pool_iters, args.warmup))

    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    setup = {k: getattr(args, k) for k in ("preset", "batch_size", "steps", "warmup", "rounds")}
    setup["input_size"] = list(size)
    rows: dict[str, dict[str, float]] = {}
    for pool in pools:
        med = statistics.median(step_s[pool])
        pool_med = statistics.median(pool_s[pool])
        rows[pool] = {
            "step_ms_median": 1e3 * med,
            "step_ms_min": 1e3 * min(step_s[pool]),
            "images_per_s": args.batch_size / med,
            "pool_fwd_bwd_ms_median": 1e3 * pool_med,
            "pool_share_pct": 100 * pool_med / med,
            "step_ms_per_round": [1e3 * s for s in step_s[pool]],
            "pool_ms_per_round": [1e3 * s for s in pool_s[pool]],
        }
    avg = rows.get("avg")
    for row in rows.values():
        row["ratio_vs_avg"] = row["step_ms_median"] / avg["step_ms_median"] if avg else None
    overhead = pool_overhead = None
    if avg and "ggem" in rows:
        overhead = 100 * (rows["ggem"]["step_ms_median"] / avg["step_ms_median"] - 1)
        pool_diff = rows["ggem"]["pool_fwd_bwd_ms_median"] - avg["pool_fwd_bwd_ms_median"]
        pool_overhead = 100 * pool_diff / avg["step_ms_median"]

    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"torch {machine['torch']}, {machine['threads']} threads, Python {machine['python']}"
    )
    print(
        f"setup: preset {args.preset}, batch {args.batch_size}, input {tuple(size)}, "
        f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up), "
        f"pooling alone x {pool_iters}; median over rounds"
    )
    head = COLUMNS
    table = [
        [
            pool,
            f"{r['step_ms_median']:.1f}",
            f"{r['step_ms_min']:.1f}",
            f"{r['images_per_s']:.0f}",
            f"{r['ratio_vs_avg']:.3f}" if r["ratio_vs_avg"] else "-",
            f"{r['pool_fwd_bwd_ms_median']:.3f}",
            f"{r['pool_share_pct']:.2f}",
        ]
        for pool, r in rows.items()
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths, strict=True)))
    if overhead is None:
        print("GGeM overhead over avg: not measured (needs both avg and ggem in --pools)")
    else:
        print(f"GGeM overhead over avg: {overhead:+.1f}% of the step (goal <= 5%)")
        print(f"  (pooling-alone estimate: {pool_overhead:+.2f}% of the avg step)")
    if args.markdown:
        print()
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        for t in table:
            print("| " + " | ".join(t) + " |")

    result = {"machine": machine, "setup": setup, "pools": rows, "ggem_overhead_pct": overhead}
    result["ggem_pool_only_overhead_pct"] = pool_overhead
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
