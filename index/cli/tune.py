"""`vitrieval-index tune INDEX --target-recall R` and `build --target-recall R`: the
search settings that reach a recall at the least latency (index/tuning.py), measured
on the index's own items and saved with it."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..tuning import DEFAULT_TUNING_QUERIES, check_target, format_params
from .arguments import ArgumentAdder, Subcommands


def add_target_recall_option(parser: ArgumentAdder) -> None:
    parser.add_argument(
        "--target-recall",
        type=float,
        metavar="R",
        help="tune the search settings (nprobe or efSearch, and the oversampling of "
        "compressed codes) to reach recall@10 R at the least latency, measured on "
        f"{DEFAULT_TUNING_QUERIES:,} of the index's own items",
    )


def add_tune_command(sub: Subcommands) -> None:
    tune = sub.add_parser(
        "tune", help="choose the search settings that reach a target recall@10, and save them"
    )
    tune.add_argument("index")
    add_target_recall_option(tune)
    tune.add_argument(
        "--queries",
        type=int,
        default=DEFAULT_TUNING_QUERIES,
        help=f"items drawn as queries (default {DEFAULT_TUNING_QUERIES:,}; as many more are "
        "held out to check the choice)",
    )
    tune.add_argument("--seed", type=int, default=0, help="of the query sample (default 0)")
    tune.set_defaults(handler=_tune)


def _tune(args: argparse.Namespace) -> int:
    if args.target_recall is None:
        raise ValueError("give --target-recall R, e.g. --target-recall 0.95")
    print(tune_index(Path(args.index), args.target_recall, args.queries, args.seed))
    return 0


def tune_index(
    index: Path, target: float, queries: int = DEFAULT_TUNING_QUERIES, seed: int = 0
) -> str:
    """Tune the index at `index` (opened for writing: refused beside a live writer) and
    save; returns the one-line summary."""
    from ..shards import open_index
    from ..shards.store import check_writable
    from ..tuning import tune

    check_target(target)
    if queries < 1:
        raise ValueError(f"--queries must be >= 1, got {queries}")
    check_writable(index)  # before minutes of measuring, not at the save
    with open_index(index) as store:
        entry = tune(store, target, queries=queries, seed=seed, report=print)
        store.save()
    verdict = "reached" if entry.reached else "NOT reached (the best recall found is kept)"
    return (
        f"{index}: target recall@{entry.k} {entry.target_recall:g} {verdict}: "
        f"{format_params(entry.params)}; recall@{entry.k} {entry.recall:.4f} on {entry.queries} "
        f"items, {entry.held_out_recall:.4f} on {entry.queries} held out; "
        f"{entry.latency_ms:.2f} ms a query"
    )
