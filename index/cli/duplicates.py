"""`vitrieval-index duplicates`: every group of near-duplicates in an index, to a JSON or
CSV file (index/duplicates.py): pairs scoring at least --threshold (or the threshold
`calibrate` measured for --precision), grouped by single linkage, each group with the
item to keep (--keep). Resumable: a killed run started again goes on from its state
file (OUT.partial, deleted once OUT is written).

`vitrieval-index calibrate`: the duplicate threshold of a precision, measured on copies
of the index's own images (index/calibration.py) and saved with the index.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from ..atomic import atomic_write_text
from ..calibration import DEFAULT_COPIES, DEFAULT_IMAGES, DEFAULT_PRECISION, LEVELS, MIN_IMAGES
from ..duplicates import BATCH, DEFAULT_KEEP, KEEP_RULES
from .arguments import Subcommands
from .common import add_runtime_options, embedder_from_args, open_index_with_model
from .ranking_options import read_filter

STATE_SUFFIX = ".partial"


def add_duplicates_command(sub: Subcommands) -> None:
    cmd = sub.add_parser("duplicates", help="list the groups of near-duplicate items")
    cmd.add_argument("index")
    which = cmd.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--threshold",
        type=float,
        metavar="T",
        help="two items are duplicates when their score (cosine) is at least T",
    )
    which.add_argument(
        "--precision",
        type=float,
        metavar="P",
        help="the threshold `calibrate` measured for precision P "
        f"({', '.join(map(str, LEVELS))} or the one it was asked for)",
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
    from ..calibration import check_precision, threshold_for
    from ..duplicates import check_keep_rule, find_duplicates, iter_csv_rows
    from ..shards import open_index

    out = Path(args.out)
    if out.suffix not in (".json", ".csv"):
        raise ValueError(f"--out must end in .json or .csv, not {out.name!r}")
    if args.batch < 1:
        raise ValueError("--batch must be at least 1")
    keep = check_keep_rule(args.keep)
    if args.precision is not None:
        check_precision(args.precision)
    flt = read_filter(args.filter)
    state = out.with_name(out.name + STATE_SUFFIX)
    store = open_index(Path(args.index))
    try:
        threshold = args.threshold
        if threshold is None:
            threshold = threshold_for(store.calibration, args.precision)
            print(f"precision {args.precision:g}: the calibrated threshold is {threshold:.4f}")
        groups = find_duplicates(
            store,
            threshold,
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


def add_calibrate_command(sub: Subcommands) -> None:
    cmd = sub.add_parser(
        "calibrate",
        help="measure the duplicate threshold of a precision on copies of the index's images",
    )
    cmd.add_argument("index")
    cmd.add_argument(
        "--precision",
        type=float,
        default=DEFAULT_PRECISION,
        metavar="P",
        help=f"the precision of the pairs found that the threshold is for (default "
        f"{DEFAULT_PRECISION}; {', '.join(map(str, LEVELS))} are measured too)",
    )
    cmd.add_argument(
        "--images",
        type=int,
        default=DEFAULT_IMAGES,
        metavar="N",
        help=f"items with image files to copy (default {DEFAULT_IMAGES}, at least {MIN_IMAGES})",
    )
    cmd.add_argument(
        "--copies",
        type=int,
        default=DEFAULT_COPIES,
        metavar="C",
        help=f"edited copies made of each image (default {DEFAULT_COPIES})",
    )
    cmd.add_argument("--seed", type=int, default=0, help="of the sample and the edits")
    cmd.add_argument("--model", help="override the index's model (same fingerprint only)")
    add_runtime_options(cmd)
    cmd.set_defaults(handler=calibrate_command)


def calibrate_command(args: argparse.Namespace) -> int:
    from ..calibration import calibrate, check_precision
    from ..shards.store import check_writable

    precision = check_precision(args.precision)
    check_writable(Path(args.index))  # before minutes of embedding, not at the save
    store, model = open_index_with_model(Path(args.index), args.model)
    with store:
        entry = calibrate(
            store,
            embedder_from_args(model, args),
            precision,
            images=args.images,
            copies=args.copies,
            seed=args.seed,
        )
        store.save()
    print(f"{args.index}: {entry.copies:,} copies of {entry.images:,} images searched "
          f"among {entry.items:,} items")  # fmt: skip
    for level in entry.levels:
        lo, hi = level.precision_interval
        rlo, rhi = level.recall_interval
        verdict = "" if level.reached else "  NOT reached (the best precision found is kept)"
        mark = "*" if level.precision == entry.precision else " "
        print(
            f"{mark} precision {level.precision:g}: threshold {level.threshold:.4f}, precision "
            f"{level.measured_precision:.4f} [{lo:.3f}, {hi:.3f}], recall {level.recall:.4f} "
            f"[{rlo:.3f}, {rhi:.3f}], {level.pairs:,} pairs{verdict}"
        )
    return 0
