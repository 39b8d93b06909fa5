"""`vitrieval-index promote DATA ALIAS CANDIDATE`: repoint an alias of a data folder to
a candidate collection only when the candidate evaluates at least as well
(index/promotion.py)."""

from __future__ import annotations

import argparse
import json

from ..promotion import DEFAULT_KS, DEFAULT_METRIC
from .arguments import Subcommands


def add_promote_command(sub: Subcommands) -> None:
    cmd = sub.add_parser(
        "promote",
        help="switch an alias to a candidate collection if it evaluates at least as well",
    )
    cmd.add_argument("data", help="the data folder (`vitrieval-serve --data DIR`)")
    cmd.add_argument("alias")
    cmd.add_argument("candidate", help="the collection to switch the alias to")
    cmd.add_argument(
        "--metric",
        default=DEFAULT_METRIC,
        help=f"the evaluation's metric compared (default {DEFAULT_METRIC}; recall@K, ...)",
    )
    cmd.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="the candidate must beat the current collection by at least this (default 0)",
    )
    cmd.add_argument(
        "--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="the K of recall@K"
    )
    cmd.add_argument("--json", action="store_true", help="print both evaluations as JSON")
    cmd.set_defaults(handler=_promote)


def _promote(args: argparse.Namespace) -> int:
    from ..collections import DataFolder
    from ..promotion import promote

    result = promote(
        DataFolder(args.data),
        args.alias,
        args.candidate,
        metric=args.metric,
        min_gain=args.min_gain,
        ks=args.ks,
    )
    if args.json:
        print(json.dumps({"switched": result.switched, "current": result.current.metrics,
                          "candidate": result.candidate.metrics}, default=str))  # fmt: skip
    else:
        print(result.summary())
    return 0
