"""`vitrieval-index recommend`: items like some examples and unlike others.

Each example is a key of the index (its stored vector; the item is left out of the
answer) or, when the index has no such key, an image file (embedded with the index's
model, as `search` embeds a query). The strategies are index/recommend.py's; the
options every ranked command shares (--label, --filter, --offset, --group-by, ...)
are ranking_options.py's.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from ..recommend import DEFAULT_STRATEGY, STRATEGIES
from .arguments import Subcommands
from .common import add_runtime_options, embedder_from_args, open_index_with_model
from .ranked_output import groups_json, hit_json, print_groups, print_hits, print_json
from .ranking_options import add_ranking_options, grouping_option, read_filter, shaping_options


def add_recommend_command(sub: Subcommands) -> None:
    cmd = sub.add_parser("recommend", help="items like some examples and unlike others")
    cmd.add_argument("index")
    cmd.add_argument(
        "--positive",
        nargs="+",
        required=True,
        metavar="EXAMPLE",
        help="examples to be near: keys of the index, or image files",
    )
    cmd.add_argument(
        "--negative",
        nargs="+",
        default=[],
        metavar="EXAMPLE",
        help="examples to be away from: keys of the index, or image files",
    )
    cmd.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=DEFAULT_STRATEGY,
        help="average_vector: search 2 avg(positive) - avg(negative); best_score: an item "
        "scores its best similarity to a positive, or minus the square of its best to a "
        "negative when that is higher",
    )
    cmd.add_argument("-k", type=int, default=10)
    add_ranking_options(cmd)
    cmd.add_argument("--model", help="override the index's model (same fingerprint only)")
    cmd.add_argument("--json", action="store_true")
    add_runtime_options(cmd)
    cmd.set_defaults(handler=recommend_command)


def example_vectors(
    store: Any, model: Any, args: argparse.Namespace, examples: list[str]
) -> tuple[np.ndarray, list[str]]:
    """float32 (n, d) vectors of the examples and the keys among them; an example that
    is neither a key nor an image file is a ValueError naming it."""
    from ..runtime.images import ImageDecodeError

    vectors: list[np.ndarray | None] = []
    keys, images = [], []
    for example in examples:
        record = store.get(example)
        if record is not None:
            vectors.append(record.vector)
            keys.append(example)
        elif Path(example).is_file():
            vectors.append(None)
            images.append(example)
        else:
            raise ValueError(f"{example!r} is neither a key of the index nor an image file")
    if images:
        embedded = embedder_from_args(model, args).embed_sources(images)
        if embedded.errors:
            raise ImageDecodeError(embedded.errors[0][1])
        rows = iter(embedded.embeddings)
        vectors = [v if v is not None else next(rows) for v in vectors]
    stacked = np.stack(vectors) if vectors else np.empty((0, store.dim), np.float32)
    return stacked.astype(np.float32), keys


def recommend_command(args: argparse.Namespace) -> int:
    from ..contract import LocalIndex
    from ..grouping import grouped
    from ..query import Where
    from ..recommend import ranking

    if args.k < 1:
        raise ValueError("-k must be at least 1")
    shaping = shaping_options(args)
    grouping = grouping_option(args)
    flt = read_filter(args.filter)
    store, model = open_index_with_model(Path(args.index), args.model)
    positive, keys = example_vectors(store, model, args, args.positive)
    negative, more = example_vectors(store, model, args, args.negative)
    where = Where(label=args.label, filter=flt, exclude_keys=keys + more)
    index = LocalIndex(store)
    examples = {"positive": args.positive, "negative": args.negative, "strategy": args.strategy}
    if grouping is not None:

        def rank(depth: int) -> Any:
            whole = {**shaping, "offset": 0}
            return ranking(index, positive, negative, args.strategy, where, whole)(depth)

        groups = asyncio.run(grouped(rank, args.k, grouping, args.offset))
        if args.json:
            print_json({**examples, "group_by": args.group_by, "groups": groups_json(groups)})
        else:
            print_groups([_title(args)], [groups], args.group_by, args.offset)
        return 0
    page = ranking(index, positive, negative, args.strategy, where, shaping)
    hits = [hit for _, hit in asyncio.run(page(args.k))]
    if args.json:
        print_json({**examples, "hits": [hit_json(h) for h in hits]})
    else:
        print_hits([_title(args)], [hits], args.offset)
    return 0


def _title(args: argparse.Namespace) -> str:
    away = f", away from {' '.join(args.negative)}" if args.negative else ""
    return f"like {' '.join(args.positive)}{away} ({args.strategy})"
