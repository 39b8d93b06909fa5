"""`vitrieval-index search`: the top-k neighbours of query images, apart from cli.py.

Each query image is its own query, or with --fuse all of them are one (index/fusion.py);
--filter narrows the hits by metadata (index/store/filters.py) and --rerank aqe re-ranks them
(alpha query expansion); the options every ranked command shares (--oversample,
--offset, --group-by, ...) are ranking_options.py's, the printing ranked_output.py's.
What follows the embedding is `vitrieval.index.query`, as the HTTP service runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..fusion import FUSIONS
from ..rerank import DEFAULT_AQE_ALPHA, DEFAULT_AQE_NEIGHBOURS, SEARCH_METHODS
from .arguments import Subcommands
from .common import add_runtime_options, embedder_from_args, open_index_with_model
from .ranked_output import groups_json, hit_json, print_groups, print_hits, print_json
from .ranking_options import add_ranking_options, grouping_option, read_filter, shaping_options

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
    add_ranking_options(search)
    search.add_argument("--model", help="override the index's model (same fingerprint only)")
    search.add_argument("--json", action="store_true")
    add_runtime_options(search)
    search.set_defaults(handler=search_command)


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
        print_json(
            [
                {
                    "query": query,
                    **({"fusion": args.fuse} if args.fuse else {}),
                    "hits": [hit_json(h) for h in hits],
                }
                for query, hits in zip(queries, results, strict=True)
            ]
        )
        return 0
    titles = [f"{' + '.join(q)} ({args.fuse} of {len(q)})" if args.fuse else q for q in queries]
    print_hits(titles, results, args.offset)
    return 0


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
    from ..query import search_store_groups

    grouping = grouping_option(args)
    assert grouping is not None  # the caller saw --group-by or --group-size
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
        print_json(
            [
                {"query": query, "group_by": args.group_by, "groups": groups_json(groups)}
                for query, groups in zip(queries, answers, strict=True)
            ]
        )
        return 0
    titles = [" + ".join(q) if args.fuse else q for q in queries]
    print_groups(titles, answers, args.group_by, args.offset)
    return 0
