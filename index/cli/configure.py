"""`vitrieval-index configure INDEX` and the same options on `build`: the settings an
index keeps for its segments (the fields filters read, DBA), apart from cli.py; and,
on `configure` alone, the search setting `--oversample`.

The segment settings shape the files a segment is written with, so changing them
rewrites the index once (a merge of everything) unless `--no-rewrite` leaves that to
the merges to come. `--oversample` (how many candidates a compressed segment re-scores
by the exact vectors) is read at search time: it is saved, and nothing is rewritten.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..rerank import DEFAULT_DBA_ALPHA, DEFAULT_DBA_NEIGHBOURS
from ..store.request import DEFAULT_OVERSAMPLE, MAX_OVERSAMPLE
from .arguments import Subcommands
from .common import checked_oversample_option

ALL_FIELDS_WORD = "all"


def add_index_settings(parser: argparse.ArgumentParser) -> None:
    """The options that set an index's segment settings (configure and build)."""
    parser.add_argument(
        "--filter-fields",
        metavar="PATHS",
        help="comma-separated metadata paths to index for search filters (e.g. "
        f"colour,shop.city), or '{ALL_FIELDS_WORD}' (the default: every scalar field); a "
        "filter on another path still works, by reading item metadata",
    )
    dba = parser.add_mutually_exclusive_group()
    dba.add_argument(
        "--dba",
        type=int,
        metavar="N",
        nargs="?",
        const=DEFAULT_DBA_NEIGHBOURS,
        help="compute DBA vectors (each item averaged with its N nearest neighbours, "
        f"default {DEFAULT_DBA_NEIGHBOURS}) for searches with augmented=true / rerank dba",
    )
    dba.add_argument("--no-dba", action="store_true", help="stop computing DBA vectors")
    parser.add_argument(
        "--dba-alpha",
        type=float,
        default=DEFAULT_DBA_ALPHA,
        help=f"DBA neighbour weight exponent (default {DEFAULT_DBA_ALPHA:g})",
    )


def add_configure_command(sub: Subcommands) -> None:
    configure = sub.add_parser(
        "configure",
        help="set an index's filter fields and DBA (rewriting it once) or its oversampling",
    )
    configure.add_argument("index")
    add_index_settings(configure)
    configure.add_argument(
        "--oversample",
        type=int,
        metavar="N",
        help="a compressed index (PQ, SQ): the candidates per k each segment re-scores by "
        f"the exact vectors when a search names none (1 to {MAX_OVERSAMPLE}; default "
        f"{DEFAULT_OVERSAMPLE}); saved without a rewrite. An exact index refuses it",
    )
    configure.add_argument(
        "--no-rewrite",
        action="store_true",
        help="only record the settings: segments written from now on follow them",
    )
    configure.set_defaults(handler=_configure)


def wants_settings(args: argparse.Namespace) -> bool:
    """Whether the command line names a setting (commands without them: no)."""
    return (
        getattr(args, "filter_fields", None) is not None
        or getattr(args, "dba", None) is not None
        or getattr(args, "no_dba", False)
    )


def apply_index_settings(args: argparse.Namespace, index: Path, rewrite: bool = True) -> str:
    """Record the settings `args` name in `index` and rewrite it; returns what changed."""
    from ..shards import open_index

    with open_index(index) as store:
        if args.filter_fields is not None:
            text = args.filter_fields.strip()
            paths = None if text == ALL_FIELDS_WORD else [p.strip() for p in text.split(",")]
            store.set_filter_fields(paths)
        if args.dba is not None:
            store.set_dba(args.dba, args.dba_alpha)
        elif args.no_dba:
            store.set_dba(None)
        store.save()
        merged = store.merge(everything=True, rewrite=True) if rewrite else 0
        info = store.info()
    fields = info.get("filter_fields")
    dba = info.get("dba")
    return (
        f"{index}: filter fields {'all' if fields is None else ','.join(fields)}; DBA "
        + ("off" if dba is None else f"{dba['neighbours']} neighbours, alpha {dba['alpha']:g}")
        + (f"; rewrote {merged} segment(s)" if rewrite else "; applies to segments written next")
    )


def apply_oversample(index: Path, oversample: int) -> str:
    """Save `oversample` as the index's re-scoring default (a StoreError for an index
    whose scores are exact); returns what it holds now."""
    from ..shards import open_index

    with open_index(index) as store:
        store.set_search_params(oversample=oversample)
        store.save()
        saved = store.search_params()["oversample"]
    return f"{index}: oversample {saved} (each compressed segment re-scores {saved} x k candidates)"


def _configure(args: argparse.Namespace) -> int:
    oversample = checked_oversample_option(args.oversample)
    if not wants_settings(args) and oversample is None:
        raise ValueError("give --filter-fields, --dba N, --no-dba or --oversample N")
    # the search setting first: it is checked against the index (an exact one refuses
    # it) before a segment setting rewrites anything
    if oversample is not None:
        print(apply_oversample(Path(args.index), oversample))
    if wants_settings(args):
        print(apply_index_settings(args, Path(args.index), rewrite=not args.no_rewrite))
    return 0
