"""How `search` and `recommend` print their answers: a table of ranked hits, or of
groups, or with --json the same as JSON (hits with their key, score, label, path and
metadata)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def hit_json(hit: Any) -> dict[str, Any]:
    """One hit as --json prints it."""
    return {
        "key": hit.key,
        "score": hit.score,
        "label": hit.label,
        "path": hit.path,
        "metadata": hit.metadata,
    }


def print_hits(titles: Sequence[Any], results: Sequence[Sequence[Any]], offset: int) -> None:
    """Each query's title, then its hits ranked from offset + 1."""
    for title, hits in zip(titles, results, strict=True):
        print(title)
        print(f"  {'rank':>4}  {'score':>7}  {'label':<16}  key")
        for rank, hit in enumerate(hits, offset + 1):
            print(f"  {rank:>4}  {hit.score:>7.4f}  {hit.label or '-':<16}  {hit.key}")


def print_groups(titles: Sequence[Any], answers: Sequence[Any], by: str, offset: int) -> None:
    """Each query's title, then its groups ranked from offset + 1 with their hits."""
    for title, groups in zip(titles, answers, strict=True):
        print(title)
        for rank, found in enumerate(groups, offset + 1):
            print(f"  group {rank}: {by} = {found.value!r}")
            for _, hit in found.hits:
                print(f"    {hit.score:>7.4f}  {hit.label or '-':<16}  {hit.key}")


def groups_json(groups: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"value": g.value, "hits": [hit_json(h) for _, h in g.hits]} for g in groups]


def print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2))
