"""`vitrieval-index search`: the top-k neighbours of query images, apart from cli.py.

Each query image is its own query, or with --fuse all of them are one (index/fusion.py);
--filter narrows the hits by metadata (index/store/filters.py) and --rerank aqe re-ranks them
(alpha query expansion); --oversample and --no-rescore set how a compressed index re-scores
its candidates (index/store/_rescore.py); --offset and --score-threshold which part of
the ranking is printed. What follows the embedding is
`vitrieval.index.query`, as the HTTP service runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..fusion import FUSIONS
from ..grouping import DEFAULT_GROUP_SIZE, MAX_GROUP_SIZE
from ..rerank import DEFAULT_AQE_ALPHA, DEFAULT_AQE_NEIGHBOURS, SEARCH_METHODS
from ..store.request import DEFAULT_OVERSAMPLE, MAX_DEPTH, MAX_OVERSAMPLE
from .arguments import ArgumentAdder, Subcommands
from .common import (
    add_runtime_options,
    checked_oversample_option,
    embedder_from_args,
    open_index_with_model,
)

if TYPE_CHECKING:
    from ..store.filters import Filter

NEAREST_FOR_KEYS = 100
"""Items a filter that matched nothing has its keys looked for in (the first query's
nearest, unfiltered): a misspelt key matches nothing, and says nothing on its own."""


def add_search_command(sub: Subcommands) -> None:
    search = sub.add_parser("search", help="top-k neighbours of query images")
    search.add_argument("index")
    search.add_argument("images", nargs="+", help="query image files")
    search.add_argument("-k", type=int, default=10)
    search.add_argument("--label", help="only return items with this label")
    search.add_argument(
        "--filter",
        metavar="JSON",
        help='only return items whose metadata satisfy this filter, e.g. \'{"must": [{"key": '
        '"colour", "match": "red"}]}\': JSON text, or @FILE to read it from FILE',
    )
    search.add_argument(
        "--fuse",
        choices=FUSIONS,
        help="search the images as one query (one result): mean (the mean of their "
        "embeddings) or max (an item scores its best similarity to any of them); without "
        "it each image is its own query",
    )
    search.add_argument(
        "--rerank",
        choices=SEARCH_METHODS,
        help="re-rank: aqe (alpha query expansion: each query is expanded with its top "
        "--aqe-n hits and searched again) or dba (rank against the index's DBA vectors, "
        "from `vitrieval-index configure INDEX --dba`)",
    )
    search.add_argument(
        "--aqe-n",
        type=int,
        metavar="N",
        help=f"with --rerank aqe: hits a query is expanded with (default {DEFAULT_AQE_NEIGHBOURS})",
    )
    search.add_argument(
        "--aqe-alpha",
        type=float,
        metavar="A",
        help="with --rerank aqe: the hits' weights are their scores to this power "
        f"(default {DEFAULT_AQE_ALPHA:g}; 0 is a plain average)",
    )
    add_rescore_options(search)
    search.add_argument(
        "--offset",
        type=int,
        default=0,
        metavar="N",
        help=f"skip the N best hits: print ranks N + 1 to N + k (k + N at most {MAX_DEPTH})",
    )
    search.add_argument(
        "--score-threshold",
        type=float,
        metavar="S",
        help="leave out hits scoring below S (a query may then print fewer than k)",
    )
    search.add_argument(
        "--group-by",
        metavar="FIELD",
        help='group the hits by FIELD ("label", or a metadata path): the -k best groups, '
        "each with its --group-size best hits (--offset then counts groups)",
    )
    search.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help=f"with --group-by: hits per group (1 to {MAX_GROUP_SIZE}, default "
        f"{DEFAULT_GROUP_SIZE})",
    )
    search.add_argument("--model", help="override the index's model (same fingerprint only)")
    search.add_argument("--json", action="store_true")
    add_runtime_options(search)
    search.set_defaults(handler=search_command)


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
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where} is not valid JSON ({exc})") from None
    return parse_filter(raw)


def _rerank(args: argparse.Namespace):
    """The alpha-QE of --rerank aqe, --aqe-n and --aqe-alpha (None without it)."""
    from ..query import AQE

    if args.rerank != "aqe":
        if args.aqe_n is not None or args.aqe_alpha is not None:
            raise ValueError("--aqe-n and --aqe-alpha need --rerank aqe")
        return None
    n = DEFAULT_AQE_NEIGHBOURS if args.aqe_n is None else args.aqe_n
    alpha = DEFAULT_AQE_ALPHA if args.aqe_alpha is None else args.aqe_alpha
    return AQE(n, alpha)  # ValueError: out of range


def missing_filter_keys(store: Any, query: Any, flt: Filter) -> str | None:
    """A note when a filter that matched nothing names metadata keys that none of the
    query's NEAREST_FOR_KEYS nearest items has (None when every key was seen)."""
    from ..query import search_store
    from ..store import flatten
    from ..store.filters import field_values

    fields = {leaf.field for leaf in flt.leaves() if not leaf.field.label}
    nearest = [hit for _, hit in search_store(store, query[None], NEAREST_FOR_KEYS)[0]]
    missing = sorted(
        field.name
        for field in fields
        if not any(field_values(field, hit.label, hit.metadata) for hit in nearest)
    )
    if not missing or not nearest:
        return None
    seen = sorted({path for hit in nearest for path, _ in flatten(hit.metadata)})
    return (
        f"the filter matched nothing, and none of the {len(nearest)} nearest items has "
        f"{', '.join(repr(name) for name in missing)} in its metadata "
        f"(they have: {', '.join(seen) if seen else 'no metadata'}); check the key's spelling"
    )


def search_command(args: argparse.Namespace) -> int:
    from ..query import Where, search_store, search_store_fused
    from ..runtime.images import ImageDecodeError

    if args.k < 1:
        raise ValueError("-k must be at least 1")
    scoring = shaping_options(args)
    where = Where(label=args.label, filter=read_filter(args.filter), augmented=args.rerank == "dba")
    rerank = _rerank(args)
    store, model = open_index_with_model(Path(args.index), args.model)
    # the embedder's own decoding, exactly as `build` decoded the catalogue
    embedded = embedder_from_args(model, args).embed_sources(args.images)
    if embedded.errors:
        raise ImageDecodeError(embedded.errors[0][1])
    if args.group_by is not None or args.group_size is not None:
        return grouped_search(args, store, embedded.embeddings, where, rerank, scoring)
    queries: list[Any]
    if args.fuse:
        found = search_store_fused(
            store,
            embedded.embeddings,
            args.k,
            fusion=args.fuse,
            where=where,
            rerank=rerank,
            **scoring,
        )
        queries = [[str(path) for path in args.images]]
        results = [[hit for _, hit in found]]
    else:
        ranked = search_store(
            store, embedded.embeddings, args.k, where=where, rerank=rerank, **scoring
        )
        queries = [str(path) for path in args.images]
        results = [[hit for _, hit in row] for row in ranked]
    if where.filter is not None and not any(results):
        note = missing_filter_keys(store, embedded.embeddings[0], where.filter)
        if note:
            print(f"vitrieval-index search: note: {note}", file=sys.stderr)
    if args.json:
        payload = [
            {
                "query": query,
                **({"fusion": args.fuse} if args.fuse else {}),
                "hits": [hit_json(h) for h in hits],
            }
            for query, hits in zip(queries, results, strict=True)
        ]
        print(json.dumps(payload, indent=2))
        return 0
    for query, hits in zip(queries, results, strict=True):
        print(f"{' + '.join(query)} ({args.fuse} of {len(query)})" if args.fuse else query)
        print(f"  {'rank':>4}  {'score':>7}  {'label':<16}  key")
        for rank, hit in enumerate(hits, args.offset + 1):
            print(f"  {rank:>4}  {hit.score:>7.4f}  {hit.label or '-':<16}  {hit.key}")
    return 0


def hit_json(hit: Any) -> dict[str, Any]:
    """One hit as --json prints it."""
    return {
        "key": hit.key,
        "score": hit.score,
        "label": hit.label,
        "path": hit.path,
        "metadata": hit.metadata,
    }


def grouped_search(
    args: argparse.Namespace,
    store: Any,
    embeddings: Any,
    where: Any,
    rerank: Any,
    scoring: dict[str, Any],
) -> int:
    """--group-by: each query's -k best groups (index/grouping.py), each with its
    --group-size best hits; every image its own query, or one with --fuse."""
    from ..grouping import describe_grouping
    from ..query import search_store_groups

    if args.group_by is None:
        raise ValueError("--group-size needs --group-by")
    grouping = describe_grouping(args.group_by, args.group_size)  # StoreError: bad values
    options = {"where": where, "rerank": rerank, **scoring}
    if args.fuse:
        queries: list[Any] = [[str(path) for path in args.images]]
        each = [embeddings]
        options["fusion"] = args.fuse
    else:
        queries = [str(path) for path in args.images]
        each = [embeddings[i : i + 1] for i in range(len(embeddings))]
    answers = [search_store_groups(store, x, args.k, grouping, **options) for x in each]
    if args.json:
        payload = [
            {
                "query": query,
                "group_by": args.group_by,
                "groups": [
                    {"value": g.value, "hits": [hit_json(h) for _, h in g.hits]} for g in groups
                ],
            }
            for query, groups in zip(queries, answers, strict=True)
        ]
        print(json.dumps(payload, indent=2))
        return 0
    for query, groups in zip(queries, answers, strict=True):
        print(" + ".join(query) if args.fuse else query)
        for rank, found in enumerate(groups, args.offset + 1):
            print(f"  group {rank}: {args.group_by} = {found.value!r}")
            for _, hit in found.hits:
                print(f"    {hit.score:>7.4f}  {hit.label or '-':<16}  {hit.key}")
    return 0
