"""Second-order heads (C-CBP, JCF) against first-order poolings: parameters, FLOPs, step time.

What is measured, per pooling (avg, ggem, ccbp, jcf by default) on one backbone preset, with
the two second-order heads at the same sizes (d, D, N; R for JCF), so that jcf and ccbp
differ only by the paper's factorisation (eq. 10 against eq. 13):

- parameters of the pooling head, and of its factorised part (C-CBP: U, V, 2NdD;
  JCF: U~, V~, A, B, 2(RdD + NR));
- forward FLOPs per image of the head and of the whole model, analytic
  (`training/flops.py`) and counted ("profiler") by `vitrieval.training.flops.counted_flops` (the
  matrix products torch dispatches, FlopCounterMode's convention, attention on its math
  backend so that every torch version counts it alike), with their ratio (1.000 when the
  formula counts what runs); and the counted FLOPs of a training pass (forward + backward)
  per image;
- time: a full training step of the whole model (forward, Norm-softmax over 10 classes,
  zero_grad, backward, clip_grad_norm_(1.0), AdamW over `vitrieval.training.optim.param_groups`) on
  one batch of random images shared by every pooling; the head alone (forward + backward
  on random tokens of the backbone's shape); and the factorised part alone (eq. 10 or 13
  on fixed local features x and assignments h, forward + backward);
- the share of the head's time spent in matrix products (torch.profiler, one pass), which
  says how far the head is bound by arithmetic rather than by memory traffic.

Every model is built from the same seed. The poolings are interleaved round-robin (round 1
times every pooling, then round 2 ...), each timing preceded by warm-up calls, so that
noise from other work on a shared machine spreads over all poolings alike; reported: the
median over rounds of the mean time per call in a round. Then jcf / ccbp for each
quantity, next to the paper's prediction R/N for the factorised part (its sec. 3.3).
Nothing is asserted.

Run:  .venv/bin/python bench/second_order.py [--preset small] [--d 256 --out-dim 512
      --codebook 32 --rank 8] [--markdown] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from torch.profiler import ProfilerActivity, profile

from vitrieval.training.backbones import PRESETS
from vitrieval.training.flops import counted_flops, model_flops, pooling_flops
from vitrieval.training.losses import create_loss
from vitrieval.training.model import build_model
from vitrieval.training.optim import param_groups
from vitrieval.training.pooling import pooling_names
from vitrieval.training.pooling.ccbp import CodebookPooling

NUM_CLASSES = 10
SEED = 0
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def timed(fn: Callable[[], Any], iterations: int, warmup: int) -> float:
    """Mean seconds per call of fn over `iterations` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def matmul_share(fn: Callable[[], Any]) -> float:
    """Share of fn's CPU time spent in matrix-product kernels (one profiled call)."""
    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    return mm / total if total else float("nan")


class Case:
    """One pooling: model, loss, optimiser, the head alone and its factorised part."""

    def __init__(
        self, preset: str, pool: str, options: dict[str, int], images: torch.Tensor
    ) -> None:
        torch.manual_seed(SEED)
        self.name = pool
        self.model = build_model(preset, pool, pool_options=options)
        self.loss = create_loss("norm_softmax", self.model.embedding_dim, NUM_CLASSES)
        groups = param_groups(self.model, self.loss, 0.05, 1.0, 10.0)
        for group in groups:
            group["lr"] = 1e-4 * group["lr_scale"]
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4)
        self.images = images
        self.labels = torch.arange(len(images)) % NUM_CLASSES
        self.model.train()
        self.prefix = self.model.num_prefix_tokens
        with torch.no_grad():
            shape = self.model.backbone.forward_features(images[:1]).shape
        self.pool = copy.deepcopy(self.model.pool)
        self.tokens = torch.randn(len(images), shape[1], shape[2], requires_grad=True)
        self.second_order = isinstance(self.pool, CodebookPooling)
        if self.second_order:
            with torch.no_grad():
                x, h = self.pool.local_features(self.tokens[:, self.prefix :])
            self.x, self.h = x.requires_grad_(), h.requires_grad_()

    def step(self) -> None:
        loss = self.loss(self.model(self.images), self.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def train_pass(self) -> None:
        """Forward and backward of the whole model and the loss, no optimiser step."""
        self.model.zero_grad(set_to_none=True)
        self.loss(self.model(self.images), self.labels).backward()

    def head_fwd_bwd(self) -> None:
        self.tokens.grad = None
        self.pool.zero_grad(set_to_none=True)
        self.pool(self.tokens, self.prefix).sum().backward()

    def factorised_fwd_bwd(self) -> None:
        self.x.grad = self.h.grad = None
        self.pool.zero_grad(set_to_none=True)
        self.pool.second_order(self.x, self.h).sum().backward()

    def cost(self) -> dict[str, Any]:
        """Parameters and FLOPs per image (analytic and counted); no timing."""
        batch = len(self.images)
        pool, model = self.pool, self.model
        tokens, width = self.tokens.shape[1] - self.prefix, self.tokens.shape[2]
        head = pooling_flops(pool, tokens, width)
        with torch.no_grad():
            head_counted = counted_flops(lambda: pool(self.tokens, self.prefix)) / batch
            model_counted = counted_flops(lambda: model(self.images)) / batch
        factorised_params = pool.factorised_parameters() if self.second_order else 0
        return {
            "head_params": sum(p.numel() for p in pool.parameters()),
            "factorised_params": factorised_params,
            "model_params": sum(p.numel() for p in model.parameters()),
            "head_flops": head["total"],
            "head_flops_profiler": head_counted,
            "factorised_flops": head["factorised"],
            "model_flops": model_flops(model)["total"],
            "model_flops_profiler": model_counted,
            "train_flops_profiler": counted_flops(self.train_pass) / batch,
        }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(title: str, head: list[str], rows: list[list[str]], markdown: bool) -> None:
    print(f"\n{title}")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if markdown:
        print()
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--pools", default="avg,ggem,ccbp,jcf", help="comma-separated names")
    parser.add_argument("--d", type=int, default=256, help="ccbp/jcf reduced width d")
    parser.add_argument("--out-dim", type=int, default=512, help="ccbp/jcf output width D")
    parser.add_argument("--codebook", type=int, default=32, help="ccbp/jcf codebook size N")
    parser.add_argument("--rank", type=int, default=8, help="jcf shared projectors R")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before each timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all numbers here")
    parser.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    unknown = [p for p in pools if p not in pooling_names()]
    if unknown or not pools:
        parser.error(f"unknown pooling {unknown}; valid: {', '.join(pooling_names())}")
    sizes = {"d": args.d, "out_dim": args.out_dim, "codebook": args.codebook}
    options = {"ccbp": sizes, "jcf": {**sizes, "rank": args.rank}}

    size = PRESETS[args.preset].data_overlay["input_size"]
    torch.manual_seed(SEED)
    images = torch.randn(args.batch_size, *size)
    cases = {pool: Case(args.preset, pool, options.get(pool, {}), images) for pool in pools}
    rows: dict[str, dict[str, Any]] = {pool: case.cost() for pool, case in cases.items()}

    # The head and its factorised part are far cheaper than a step: more calls per timing.
    part_iters = 2 * args.steps
    times: dict[str, dict[str, list[float]]] = {
        p: {"step": [], "head": [], "fact": []} for p in pools
    }
    for _ in range(args.rounds):
        for pool, case in cases.items():
            times[pool]["step"].append(timed(case.step, args.steps, args.warmup))
            times[pool]["head"].append(timed(case.head_fwd_bwd, part_iters, args.warmup))
            if case.second_order:
                times[pool]["fact"].append(timed(case.factorised_fwd_bwd, part_iters, args.warmup))
    for pool, case in cases.items():
        row, t = rows[pool], times[pool]
        row["step_ms_median"] = 1e3 * statistics.median(t["step"])
        row["step_ms_min"] = 1e3 * min(t["step"])
        row["images_per_s"] = args.batch_size / statistics.median(t["step"])
        row["head_ms_median"] = 1e3 * statistics.median(t["head"])
        row["factorised_ms_median"] = 1e3 * statistics.median(t["fact"]) if t["fact"] else None
        row["head_matmul_share"] = matmul_share(case.head_fwd_bwd)
        row["step_ms_per_round"] = [1e3 * s for s in t["step"]]
    base = rows.get("avg")
    for row in rows.values():
        for key in ("model_params", "model_flops", "train_flops_profiler", "step_ms_median"):
            row[f"{key}_vs_avg"] = ratio(row[key], base[key]) if base else None

    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    setup = {k: getattr(args, k) for k in ("preset", "batch_size", "steps", "warmup", "rounds")}
    setup.update(input_size=list(size), tokens=list(cases[pools[0]].tokens.shape[1:]), **sizes)
    setup["rank"] = args.rank
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"torch {machine['torch']}, {machine['threads']} threads, Python {machine['python']}"
    )
    print(
        f"setup: preset {args.preset}, batch {args.batch_size}, input {tuple(size)}, tokens "
        f"{tuple(setup['tokens'])}; ccbp/jcf d={args.d} D={args.out_dim} N={args.codebook}, "
        f"jcf R={args.rank}; {args.rounds} rounds x {args.steps} steps (+{args.warmup} "
        f"warm-up), head and factorised part x {part_iters}; median over rounds"
    )

    mflop = 1e-6
    print_table(
        "Cost per image (FLOPs: forward; 'profiler' = counted_flops; a/p = analytic/profiler)",
        [
            *("pool", "head params", "fact. params", "head MFLOP", "profiler", "a/p"),
            *("fact. MFLOP", "model MFLOP", "profiler", "a/p", "vs avg", "train MFLOP", "vs avg"),
        ],
        [
            [
                pool,
                f"{r['head_params']:,}",
                f"{r['factorised_params']:,}",
                f"{mflop * r['head_flops']:.1f}",
                f"{mflop * r['head_flops_profiler']:.1f}",
                fmt(ratio(r["head_flops"], r["head_flops_profiler"]), ".3f"),
                f"{mflop * r['factorised_flops']:.1f}",
                f"{mflop * r['model_flops']:.1f}",
                f"{mflop * r['model_flops_profiler']:.1f}",
                fmt(ratio(r["model_flops"], r["model_flops_profiler"]), ".3f"),
                fmt(r["model_flops_vs_avg"], ".2f"),
                f"{mflop * r['train_flops_profiler']:.0f}",
                fmt(r["train_flops_profiler_vs_avg"], ".2f"),
            ]
            for pool, r in rows.items()
        ],
        args.markdown,
    )
    print_table(
        "Time (ms; training step of the whole model, head and factorised part fwd+bwd)",
        ["pool", "step ms", "min ms", "img/s", "step vs avg", "head ms", "head mm %", "fact. ms"],
        [
            [
                pool,
                f"{r['step_ms_median']:.1f}",
                f"{r['step_ms_min']:.1f}",
                f"{r['images_per_s']:.0f}",
                fmt(r["step_ms_median_vs_avg"], ".2f"),
                f"{r['head_ms_median']:.1f}",
                f"{100 * r['head_matmul_share']:.0f}",
                fmt(r["factorised_ms_median"], ".1f"),
            ]
            for pool, r in rows.items()
        ],
        args.markdown,
    )

    versus = None
    if "jcf" in rows and "ccbp" in rows:
        jcf, ccbp = rows["jcf"], rows["ccbp"]
        predicted = args.rank / args.codebook
        quantities = [
            ("factorised parameters", "factorised_params"),
            ("factorised FLOPs / image", "factorised_flops"),
            ("factorised part fwd+bwd time", "factorised_ms_median"),
            ("head parameters", "head_params"),
            ("head FLOPs / image", "head_flops"),
            ("head fwd+bwd time", "head_ms_median"),
            ("model FLOPs / image", "model_flops"),
            ("training step time", "step_ms_median"),
        ]
        versus = {key: ratio(jcf[key], ccbp[key]) for _, key in quantities}
        print_table(
            f"jcf / ccbp at equal N = {args.codebook}: the paper predicts R/N = "
            f"{args.rank}/{args.codebook} = {predicted:.3f} for the factorised part",
            ["quantity", "jcf", "ccbp", "jcf/ccbp", "paper R/N"],
            [
                [
                    label,
                    fmt(jcf[key], ",.1f" if key.endswith("_ms_median") else ",.0f"),
                    fmt(ccbp[key], ",.1f" if key.endswith("_ms_median") else ",.0f"),
                    fmt(versus[key], ".3f"),
                    f"{predicted:.3f}" if key.startswith("factorised") else "-",
                ]
                for label, key in quantities
            ],
            args.markdown,
        )

    result = {"machine": machine, "setup": setup, "pools": rows, "jcf_over_ccbp": versus}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
