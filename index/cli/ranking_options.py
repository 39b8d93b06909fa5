"""The options of every command answered by a ranking (`search`, `recommend`): which
items (--label, --filter), how a compressed index scores them (--oversample,
--no-rescore), which page (--offset, --score-threshold) and grouping (--group-by,
--group-size); read back into `Query`'s shaping and a `Grouping`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..grouping import DEFAULT_GROUP_SIZE, MAX_GROUP_SIZE
from ..json_text import parse_json
from ..store.request import DEFAULT_OVERSAMPLE, MAX_DEPTH, MAX_OVERSAMPLE
from .arguments import ArgumentAdder
from .common import checked_oversample_option

if TYPE_CHECKING:
    from ..grouping import Grouping
    from ..store.filters import Filter


def add_ranking_options(parser: ArgumentAdder) -> None:
    """The options above, on `parser`."""
    parser.add_argument("--label", help="only return items with this label")
    parser.add_argument(
        "--filter",
        metavar="JSON",
        help='only return items whose metadata satisfy this filter, e.g. \'{"must": [{"key": '
        '"colour", "match": "red"}]}\': JSON text, or @FILE to read it from FILE',
    )
    add_rescore_options(parser)
    parser.add_argument(
        "--offset",
        type=int,
        default=0,
        metavar="N",
        help=f"skip the N best hits: print ranks N + 1 to N + k (k + N at most {MAX_DEPTH})",
    )
    parser.add_argument(
        "--score-threshold",
        type=float,
        metavar="S",
        help="leave out hits scoring below S (a query may then print fewer than k)",
    )
    parser.add_argument(
        "--group-by",
        metavar="FIELD",
        help='group the hits by FIELD ("label", or a metadata path): the -k best groups, '
        "each with its --group-size best hits (--offset then counts groups)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help=f"with --group-by: hits per group (1 to {MAX_GROUP_SIZE}, default "
        f"{DEFAULT_GROUP_SIZE})",
    )


def add_rescore_options(parser: ArgumentAdder) -> None:
    """--oversample N and --no-rescore: how an index that scores from compressed codes
    (PQ, SQ) ranks each segment's candidates; exact indexes ignore both."""
    parser.add_argument(
        "--oversample",
        type=int,
        metavar="N",
        help="a compressed index (PQ, SQ): each segment takes N x k candidates from its "
        "codes and ranks them by their exact vectors (1 to "
        f"{MAX_OVERSAMPLE}; default the index's setting, from `configure --oversample`, "
        f"else {DEFAULT_OVERSAMPLE})",
    )
    parser.add_argument(
        "--no-rescore",
        dest="rescore",
        action="store_false",
        help="a compressed index: rank by the codes' approximate scores alone",
    )


def rescore_options(args: argparse.Namespace) -> dict[str, Any]:
    """The search's `rescore` and `oversample` from --no-rescore and --oversample,
    checked (ValueError: out of range, or an oversampling with nothing re-scored)."""
    oversample = checked_oversample_option(args.oversample)
    if oversample is not None and not args.rescore:
        raise ValueError("--oversample sets how many candidates are re-scored: drop --no-rescore")
    return {"rescore": args.rescore, "oversample": oversample}


def shaping_options(args: argparse.Namespace) -> dict[str, Any]:
    """`rescore_options` and the page: --offset and --score-threshold (checked by the
    search's `Query`, a StoreError naming the limit)."""
    return rescore_options(args) | {"offset": args.offset, "score_threshold": args.score_threshold}


def read_filter(text: str | None) -> Filter | None:
    """--filter's JSON text (or @FILE's), parsed into the filter language's `Filter`
    (what the search takes): a bad one is a FilterError (a StoreError) or ValueError
    naming the problem."""
    from ..store.filters import parse_filter

    if text is None:
        return None
    where = "--filter"
    if text.startswith("@"):
        where = f"--filter {text}"
        text = Path(text[1:]).read_text(encoding="utf-8")
    try:
        raw = parse_json(text)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc})") from None
    return parse_filter(raw)


def grouping_option(args: argparse.Namespace) -> Grouping | None:
    """--group-by and --group-size as a `Grouping` (None without them; a StoreError
    names a bad value, a ValueError --group-size alone)."""
    from ..grouping import describe_grouping

    if args.group_by is None and args.group_size is not None:
        raise ValueError("--group-size needs --group-by")
    return describe_grouping(args.group_by, args.group_size)
