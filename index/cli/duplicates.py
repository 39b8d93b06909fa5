"""`vitrieval-index duplicates`: every group of near-duplicates in an index, to a JSON or
CSV file (index/duplicates.py): pairs scoring at least --threshold, grouped by single
linkage, each group with the item to keep (--keep). Resumable: a killed run started
again goes on from its state file (OUT.partial, deleted once OUT is written).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from ..atomic import atomic_write_text
from ..duplicates import BATCH, DEFAULT_KEEP, KEEP_RULES
from .arguments import Subcommands
from .ranking_options import read_filter

STATE_SUFFIX = ".partial"


def add_duplicates_command(sub: Subcommands) -> None:
    cmd = sub.add_parser("duplicates", help="list the groups of near-duplicate items")
    cmd.add_argument("index")
    cmd.add_argument(
        "--threshold",
        type=float,
        required=True,
        metavar="T",
        help="two items are duplicates when their score (cosine) is at least T",
    )
    cmd.add_argument(
        "--out", required=True, help="FILE.json (a list of groups) or FILE.csv (a row per item)"
    )
    cmd.add_argument(
        "--filter", metavar="JSON", help="only items this metadata filter allows (or @FILE)"
    )
    cmd.add_argument(
        "--keep",
        default=DEFAULT_KEEP,
        metavar="RULE",
        help=f"which item of a group to keep: {', '.join(KEEP_RULES)} (default {DEFAULT_KEEP})",
    )
    cmd.add_argument("--batch", type=int, default=BATCH, help="items searched at a time")
    cmd.set_defaults(handler=duplicates_command)


def duplicates_command(args: argparse.Namespace) -> int:
    from ..duplicates import check_keep_rule, find_duplicates, iter_csv_rows
    from ..shards import open_index

    out = Path(args.out)
    if out.suffix not in (".json", ".csv"):
        raise ValueError(f"--out must end in .json or .csv, not {out.name!r}")
    if args.batch < 1:
        raise ValueError("--batch must be at least 1")
    keep = check_keep_rule(args.keep)
    flt = read_filter(args.filter)
    state = out.with_name(out.name + STATE_SUFFIX)
    store = open_index(Path(args.index))
    try:
        groups = find_duplicates(
            store,
            args.threshold,
            filter=flt,
            keep=keep,
            state=state,
            batch=args.batch,
            progress=lambda n: print(f"  {n:,} items searched", end="\r", file=sys.stderr),
        )
    finally:
        store.close()
    if out.suffix == ".json":
        atomic_write_text(out, json.dumps([g.as_json() for g in groups], indent=2) + "\n")
    else:
        text = io.StringIO()
        csv.writer(text).writerows(iter_csv_rows(groups))
        atomic_write_text(out, text.getvalue())
    state.unlink(missing_ok=True)
    items = sum(len(g.keys) for g in groups)
    print(f"{len(groups):,} groups of near-duplicates ({items:,} items) written to {out}")
    return 0
