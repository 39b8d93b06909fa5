"""Filtered search in the index store: latency and recall@10 per selectivity.

Per factory (default "Flat" and "IVF1024,Flat"), an index of N clustered unit vectors
(default 200,000 x 64) is built once in a temporary folder (`IndexStore.create`,
train on up to 50,000 of them, add in batches of 10,000, save, reopen), each item
with the metadata

    {"rank": r, "colour": c, "category": g, "unindexed_rank": r}

- `rank`: an integer in [0, 100000), exactly uniform (a permutation scaled down), so
  `{"key": "rank", "range": {"lt": s * 100000}}` allows exactly a fraction s;
- `colour`: red 50%, blue 25%, green 15%, black 9%, purple 1% (exact counts);
- `category`: the item's cluster (of 4,096) mod 20, so correlated with the vectors as
  a product category is with its images: `category = 0` allows about 5% of the items,
  all in 5% of the clusters, and most queries' neighbours lie elsewhere (the hard case
  for a widened IVF search, which probes the lists nearest the query);
- `unindexed_rank`: the same value as `rank`, outside the index's `filter_fields`
  (["category", "colour", "rank"]): a filter on it takes the field index's fallback,
  reading every item's metadata (fields.py), the same as `filter_fields=["colour"]`
  then filtering on rank, without a second index to build.

The vectors are spread so that IVF1024 at its default nprobe (64) finds about 0.96 of
the true top 10 unfiltered: recall can move either way with a filter.

For no filter, `rank < s * 100000` at s = 0.1%, 1%, 10%, 50%, 100%, `colour = purple`,
`colour any [green, black]`, `must_not colour = red`, `category = 0`, `category any
0-4`, and two filters that follow the query: `category = the query's` (its own
category: the neighbours it has are allowed) and `must_not category = the query's`
(every category but its own: 95% of the items, none of them in the query's cluster),
measured per factory:

- allowed: the items the filter allows (the mean over the queries where the filter
  follows the query); plan: how the store searches the segment, read
  from the allowed count as index/store/_search.py decides it: "exact" (at most
  `filtering.EXACT_SEARCH_MAX` items: brute force over their stored vectors),
  "selector" (the FAISS search with an ID selector, IVF nprobe widened by 1/s up to
  nlist), "selector-not" (a negated set: the plain search with the excluded items
  blocked);
- filter eval: `parse_filter` + `search.allowed_in` over the segments alone, the first
  evaluation of the condition ("cold": SQLite reads the field index) and the median of
  repeats ("warm": sealed segments remember recent conditions, where the store does);
- single queries (batch 1, k = 10, as the HTTP service issues them), the same filter
  for every query: p50 / p99 latency, the ratio to the unfiltered search's, and
  recall@10 against filtered brute force (numpy over the allowed subset);
- the same with the exact plan disabled (`filtering.EXACT_SEARCH_MAX = 0`: every
  filter goes to the ID-selector search), and the ratio planner / selector-only p50;
- "fresh": p50 with a new filter object for every query (the rank bound moved by a
  fraction, allowing the same items), so no remembered condition serves it: the
  latency of filters that do not repeat.

Then the fallback: `unindexed_rank < s * 100000` at a low and a high selectivity:
cold / warm evaluation, p50 with a repeated and with fresh filters (a few queries, each
reads every item's metadata), recall@10, against the indexed field's figures.

The timed searches run with one FAISS thread (`--threads`): a single query gains
little from more, and on a shared machine every OpenMP region waits for its slowest
thread. The load average is printed before and after.

Run:  .venv/bin/python bench/filtered_search.py [--n 200000] [--dim 64]
      [--factories Flat IVF1024,Flat] [--queries 200] [--json OUT]
      (about 5 minutes on 2 busy cores; `--quick`, a smoke run of N = 20,000 with
      "Flat" and "IVF128,Flat" and 50 queries, well under a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from machine import cpu_model, git, load_average  # bench/machine.py (scripts run from bench/)

from vitrieval.index.store import IndexStore
from vitrieval.index.store import _filter_plans as filtering
from vitrieval.index.store._search import allowed_in
from vitrieval.index.store._vectors import capped
from vitrieval.index.store.filters import parse_filter

K = 10
SEED = 20240611
CLUSTERS = 4096
CATEGORIES = 20
RANK_RANGE = 100_000
SELECTIVITIES = (0.001, 0.01, 0.1, 0.5, 1.0)
FALLBACK_SELECTIVITIES = (0.01, 0.5)
COLOURS = ("red", "blue", "green", "black", "purple")
COLOUR_SHARES = (0.50, 0.25, 0.15, 0.09, 0.01)
ADD_BATCH = 10_000
TRAIN_MAX = 50_000
Row = dict[str, Any]
RawFilter = dict[str, Any] | None


# -- data ------------------------------------------------------------------------------


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def clustered(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n unit vectors from a mixture of CLUSTERS Gaussian clusters on the sphere (the
    mixture is fixed; `seed` draws the points), and each one's cluster. Spread so that
    IVF1024 at its default nprobe (64) finds about 0.96 of the true top 10."""
    meta = np.random.default_rng(SEED)
    centres = unit(meta.standard_normal((CLUSTERS, dim)))
    weights = meta.dirichlet(np.full(CLUSTERS, 2.0))
    spread = meta.uniform(0.6, 1.0, CLUSTERS).astype(np.float32) / np.sqrt(dim)
    rng = np.random.default_rng(seed)
    c = rng.choice(CLUSTERS, size=n, p=weights)
    noise = rng.standard_normal((n, dim), dtype=np.float32) * spread[c, None]
    return unit(centres[c] + noise), c


def catalogue(n: int, cluster: np.ndarray) -> dict[str, np.ndarray]:
    """rank (exactly uniform over [0, RANK_RANGE)), colour index (exact shares), both
    independent of the vectors, and category (the item's cluster mod CATEGORIES: a
    field correlated with the vectors, as a product category is with its images)."""
    rng = np.random.default_rng(SEED + 1)
    rank = rng.permutation(n).astype(np.int64) * RANK_RANGE // n
    bounds = np.cumsum(np.asarray(COLOUR_SHARES)) * n
    colour = np.searchsorted(bounds, rng.permutation(n), side="right")
    return {"rank": rank, "colour": colour, "category": cluster % CATEGORIES}


def metadata_rows(fields: dict[str, np.ndarray], start: int, stop: int) -> list[dict]:
    rank, colour = fields["rank"][start:stop].tolist(), fields["colour"][start:stop].tolist()
    category = fields["category"][start:stop].tolist()
    return [
        {"rank": r, "colour": COLOURS[c], "category": g, "unindexed_rank": r}
        for r, c, g in zip(rank, colour, category, strict=True)
    ]


# -- the filters measured ----------------------------------------------------------------


class Case:
    """One filter measured: `make(i, jitter)` is query i's raw filter (the same for
    every query unless the case follows the query's own category), `jitter` moving a
    range bound without changing the items allowed (cases that `vary`); `key(i)` names
    query i's filter (queries with one key share it) and `mask(i)` the items it allows
    (None: no filter)."""

    def __init__(
        self,
        name: str,
        make: Callable[[int, float], RawFilter],
        mask: Callable[[int], np.ndarray] | None,
        *,
        key: Callable[[int], int] = lambda _i: 0,
        varies: bool = False,
        selectivity: float | None = None,
    ) -> None:
        self.name, self.make, self.mask, self.key = name, make, mask, key
        self.varies, self.selectivity = varies, selectivity

    def groups(self, queries: int) -> dict[int, list[int]]:
        """The queries sharing each filter, by key."""
        out: dict[int, list[int]] = {}
        for i in range(queries):
            out.setdefault(self.key(i), []).append(i)
        return out


def fixed(name: str, raw: RawFilter, mask: np.ndarray | None) -> Case:
    return Case(name, lambda _i, _j: raw, None if mask is None else lambda _i: mask)


def rank_case(fields: dict[str, np.ndarray], s: float, key: str = "rank") -> Case:
    bound = s * RANK_RANGE
    mask = fields["rank"] < bound

    def make(_i: int, jitter: float) -> RawFilter:
        # ranks are integers: any bound in (bound - 1, bound] allows the same items
        return {"must": [{"key": key, "range": {"lt": bound - jitter}}]}

    name = f"{key} < {s:g}·10⁵ ({s:.1%})"
    return Case(name, make, lambda _i: mask, varies=True, selectivity=s)


def cases(fields: dict[str, np.ndarray], query_category: np.ndarray) -> list[Case]:
    colour, category = fields["colour"], fields["category"]
    idx = {name: i for i, name in enumerate(COLOURS)}
    own = {int(g): category == g for g in np.unique(query_category)}

    def of_query(i: int) -> int:
        return int(query_category[i])

    return [
        fixed("none", None, None),
        *(rank_case(fields, s) for s in SELECTIVITIES),
        fixed(
            "colour = purple",
            {"must": [{"key": "colour", "match": "purple"}]},
            colour == idx["purple"],
        ),
        fixed(
            "colour any [green, black]",
            {"must": [{"key": "colour", "match": {"any": ["green", "black"]}}]},
            np.isin(colour, [idx["green"], idx["black"]]),
        ),
        fixed(
            "must_not colour = red",
            {"must_not": [{"key": "colour", "match": "red"}]},
            colour != idx["red"],
        ),
        fixed(
            "category = 0 (correlated)",
            {"must": [{"key": "category", "match": 0}]},
            category == 0,
        ),
        fixed(
            "category any 0-4 (correlated)",
            {"must": [{"key": "category", "match": {"any": [0, 1, 2, 3, 4]}}]},
            category < 5,
        ),
        Case(
            "category = the query's",
            lambda i, _j: {"must": [{"key": "category", "match": of_query(i)}]},
            lambda i: own[of_query(i)],
            key=of_query,
        ),
        Case(
            "must_not category = the query's",
            lambda i, _j: {"must_not": [{"key": "category", "match": of_query(i)}]},
            lambda i: ~own[of_query(i)],
            key=of_query,
        ),
    ]


def jitter(i: int) -> float:
    """A distinct bound shift in (0, 1) per query number (up to 100,000 queries)."""
    return (i + 1) * 1e-5


# -- reference ----------------------------------------------------------------------------


def brute_force(x: np.ndarray, q: np.ndarray, mask: np.ndarray | None) -> list[set[int]]:
    """The exact top-k ids among the allowed items, per query."""
    ids = np.arange(len(x)) if mask is None else np.flatnonzero(mask)
    sub = x[ids]
    kk = min(K, len(ids))
    out: list[set[int]] = []
    for start in range(0, len(q), 50):
        scores = q[start : start + 50] @ sub.T
        top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
        out.extend(set(ids[row].tolist()) for row in top)
    return out


def reference(x: np.ndarray, q: np.ndarray, case: Case) -> list[set[int]]:
    """Filtered brute force for every query of `case`."""
    out: list[set[int]] = [set() for _ in range(len(q))]
    for members in case.groups(len(q)).values():
        mask = None if case.mask is None else case.mask(members[0])
        for i, found in zip(members, brute_force(x, q[members], mask), strict=True):
            out[i] = found
    return out


def recall(found: list[list[int]], exact: list[set[int]]) -> float:
    hits = [len(set(f) & e) / max(len(e), 1) for f, e in zip(found, exact, strict=True)]
    return float(np.mean(hits))


# -- measuring ----------------------------------------------------------------------------


def segments(store: IndexStore) -> list[Any]:
    return [s for s in store._state.serving() if s.live_count]


def evaluate(store: IndexStore, raw: RawFilter) -> tuple[float, list[filtering.IdSet]]:
    """Seconds to parse `raw` and evaluate it over every segment, and the sets."""
    t0 = time.perf_counter()
    flt = parse_filter(raw)
    sets = [allowed_in(s, flt) for s in segments(store)]
    return time.perf_counter() - t0, sets


def _exact_limit(segment, exact_max: int) -> int:
    """The most allowed items search.py scores exactly in this segment."""
    if segment.vectors.exact:
        return min(exact_max, filtering.EXACT_SEARCH_MAX_FLAT)
    return exact_max


def plan(store: IndexStore, sets: list[filtering.IdSet] | None, exact_max: int) -> str:
    """How search.py searches each segment, from its allowed set (as it decides)."""
    settings = store.search_params()
    parts = []
    segs = segments(store)
    for segment, allowed in zip(segs, [None] * len(segs) if sets is None else sets, strict=True):
        live = segment.live_count
        if allowed is None:
            kind, matches = "plain", live
        elif allowed.negated:
            kind, matches = "selector-not", max(live - allowed.ids.size, 0)
        elif allowed.ids.size == 0:
            parts.append("empty")
            continue
        elif allowed.ids.size <= _exact_limit(segment, exact_max):
            parts.append("exact")
            continue
        else:
            kind, matches = "selector", allowed.ids.size
        if "nprobe" in settings:
            widen = filtering.widening(matches, live)
            kind += f", nprobe {capped(settings['nprobe'], widen, settings['nlist'])}"
        parts.append(kind)
    counted = Counter(parts)
    return "; ".join(p if c == 1 else f"{c}x {p}" for p, c in counted.items())


def pct(seconds: list[float], p: float) -> float:
    return 1e3 * float(np.percentile(np.asarray(seconds), p)) if seconds else float("nan")


def timed_searches(
    store: IndexStore, q: np.ndarray, case: Case, warm: int, fresh: bool = False
) -> tuple[list[float], list[list[int]]]:
    """One query at a time: (seconds each, hit ids each); `warm` untimed ones first.
    fresh: every search's filter a new object (its range bound moved by jitter)."""

    def raw(i: int, number: int) -> RawFilter:
        return case.make(i % len(q), jitter(number) if fresh else 0.0)

    for w in range(warm):  # numbered past the timed ones: fresh filters stay fresh
        store.search(q[w % len(q)][None], K, filter=raw(w, len(q) + w))
    times, found = [], []
    for i in range(len(q)):
        flt = raw(i, i)
        t0 = time.perf_counter()
        hits = store.search(q[i][None], K, filter=flt)[0]
        times.append(time.perf_counter() - t0)
        found.append([int(h.key) for h in hits])
    return times, found


def eval_figures(store: IndexStore, raw: RawFilter, repeats: int) -> Row:
    """Cold (first) and warm (median of repeats, at most ~1 s of them) evaluation."""
    cold, _ = evaluate(store, raw)
    warm = []
    budget = time.perf_counter() + 1.0
    while len(warm) < repeats and (len(warm) < 3 or time.perf_counter() < budget):
        warm.append(evaluate(store, raw)[0])
    return {"eval_cold_ms": 1e3 * cold, "eval_warm_ms": 1e3 * float(np.median(warm))}


def plans(store: IndexStore, case: Case, queries: int, exact_max: int) -> str:
    """The plan of every query's filter ("exact x150; selector x50" when they differ)."""
    counted: Counter[str] = Counter()
    for members in case.groups(queries).values():
        raw = case.make(members[0], 0.0)
        sets = None if raw is None else evaluate(store, raw)[1]
        counted[plan(store, sets, exact_max)] += len(members)
    if len(counted) == 1:
        return next(iter(counted))
    return "; ".join(f"{p} x{c}" for p, c in counted.most_common())


def bench_factory(
    factory: str,
    x: np.ndarray,
    fields: dict[str, np.ndarray],
    q: np.ndarray,
    measured: list[Case],
    exact: dict[str, list[set[int]]],
    work: Path,
    args: argparse.Namespace,
) -> Row:
    n = len(x)
    directory = work / factory.replace(",", "_")
    print(f"\n== {factory}: building {n:,} x {x.shape[1]}", flush=True)
    t0 = time.perf_counter()
    store = IndexStore.create(directory, dim=x.shape[1], factory=factory,
                              filter_fields=["category", "colour", "rank"])  # fmt: skip
    if store.needs_training():
        faiss.omp_set_num_threads(os.cpu_count() or 1)
        store.train(x[np.random.default_rng(SEED + 2).permutation(n)[:TRAIN_MAX]])
    for start in range(0, n, ADD_BATCH):
        stop = min(n, start + ADD_BATCH)
        keys = [str(i) for i in range(start, stop)]
        store.add(keys, x[start:stop], metadata=metadata_rows(fields, start, stop))
    store.save()
    store.close()
    faiss.omp_set_num_threads(args.threads)
    store = IndexStore.open(directory)
    build_s = time.perf_counter() - t0
    out: Row = {
        "factory": factory,
        "build_s": build_s,
        "segments": len(segments(store)),
        "search_params": store.search_params(),
        "exact_search_max": filtering.EXACT_SEARCH_MAX,
        "leaf_cache": any(hasattr(s, "_leaf_cache") for s in segments(store)),
        "cases": [],
        "fallback": [],
    }
    print(
        f"  built in {build_s:.1f} s: {out['segments']} segment(s), search params "
        f"{out['search_params']}, EXACT_SEARCH_MAX {filtering.EXACT_SEARCH_MAX:,}",
        flush=True,
    )
    planned_max = filtering.EXACT_SEARCH_MAX
    try:
        for case in measured:
            out["cases"].append(bench_case(store, case, q, exact[case.name], planned_max, args))
        for s in args.fallback:
            indexed = next(c for c in out["cases"] if c.get("selectivity") == s)
            row = bench_fallback(store, fields, s, q, exact[indexed["filter"]], args)
            row["indexed_fresh_p50_ms"] = indexed.get("fresh_p50_ms")
            row["indexed_eval_cold_ms"] = indexed.get("eval_cold_ms")
            out["fallback"].append(row)
    finally:
        filtering.EXACT_SEARCH_MAX = planned_max
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    return out


def bench_case(
    store: IndexStore,
    case: Case,
    q: np.ndarray,
    exact: list[set[int]],
    planned_max: int,
    args: argparse.Namespace,
) -> Row:
    row: Row = {"filter": case.name, "selectivity": case.selectivity}
    groups = case.groups(len(q))
    row["per_query"] = len(groups) > 1
    if case.mask is not None:
        row |= eval_figures(store, case.make(0, 0.0), args.eval_repeats)
        sizes = [len(m) * int(case.mask(m[0]).sum()) for m in groups.values()]
        row["allowed"] = round(sum(sizes) / len(q))  # the mean over the queries
    else:
        row["allowed"] = sum(s.live_count for s in segments(store))
    for mode, exact_max in (("planner", planned_max), ("selector_only", 0)):
        filtering.EXACT_SEARCH_MAX = exact_max
        row[f"{mode}_plan"] = plans(store, case, len(q), exact_max)
        times, found = timed_searches(store, q, case, args.warm)
        row[f"{mode}_p50_ms"], row[f"{mode}_p99_ms"] = pct(times, 50), pct(times, 99)
        row[f"{mode}_recall"] = recall(found, exact)
        if case.mask is None:
            break  # no filter: nothing for the planner to choose
    filtering.EXACT_SEARCH_MAX = planned_max
    if case.varies and args.fresh_queries:
        fq = q[: args.fresh_queries]
        times, found = timed_searches(store, fq, case, args.warm, fresh=True)
        row["fresh_p50_ms"], row["fresh_p99_ms"] = pct(times, 50), pct(times, 99)
        row["fresh_recall"] = recall(found, exact[: len(fq)])
    nan = float("nan")
    print(
        f"  {case.name:32} allowed {row['allowed']:>9,}  {row['planner_plan']:24} "
        f"eval {row.get('eval_cold_ms', 0):7.2f} / {row.get('eval_warm_ms', 0):6.3f} ms  "
        f"p50/p99 {row['planner_p50_ms']:6.2f}/{row['planner_p99_ms']:6.2f} ms  "
        f"recall {row['planner_recall']:.3f}  selector-only "
        f"{row.get('selector_only_p50_ms', nan):6.2f}/{row.get('selector_only_p99_ms', nan):6.2f}"
        f" ms recall {row.get('selector_only_recall', nan):.3f}  "
        f"fresh p50 {row.get('fresh_p50_ms', nan):.2f} ms",
        flush=True,
    )
    return row


def bench_fallback(
    store: IndexStore,
    fields: dict[str, np.ndarray],
    s: float,
    q: np.ndarray,
    exact: list[set[int]],
    args: argparse.Namespace,
) -> Row:
    """A filter on a field outside filter_fields: every evaluation reads the metadata
    (where the store remembers conditions, only a condition's first)."""
    case = rank_case(fields, s, key="unindexed_rank")
    row: Row = {"filter": case.name, "selectivity": s, "allowed": round(s * len(fields["rank"]))}
    row |= eval_figures(store, case.make(0, 0.0), 3)
    row["plan"] = plans(store, case, 1, filtering.EXACT_SEARCH_MAX)
    times, found = timed_searches(store, q, case, args.warm)
    row["p50_ms"], row["p99_ms"] = pct(times, 50), pct(times, 99)
    row["recall"] = recall(found, exact)
    fq = q[: args.fallback_queries]
    times, found = timed_searches(store, fq, case, 0, fresh=True)
    row["fresh_p50_ms"], row["fresh_p99_ms"] = pct(times, 50), pct(times, 99)
    row["fresh_recall"] = recall(found, exact[: len(fq)])
    print(
        f"  fallback {case.name:28} eval {row['eval_cold_ms']:8.1f} / "
        f"{row['eval_warm_ms']:8.3f} ms  repeated p50 {row['p50_ms']:.2f} ms  fresh p50 "
        f"{row['fresh_p50_ms']:.1f} ms  recall {row['recall']:.3f}",
        flush=True,
    )
    return row


# -- report ------------------------------------------------------------------------------


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def ms(v: float | None) -> str:
    if v is None or v != v:
        return "–"
    return f"{v:.3f}" if v < 0.1 else f"{v:.2f}" if v < 100 else f"{v:,.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or a != a or not b else f"{a / b:.2f}"


def markdown(results: list[Row], n: int, dim: int, queries: int) -> str:
    parts = []
    for res in results:
        base = res["cases"][0]
        b50, b99 = base["planner_p50_ms"], base["planner_p99_ms"]
        rows = []
        for r in res["cases"]:
            filtered = r["filter"] != "none"
            rows.append(
                [
                    r["filter"],
                    f"{r['allowed']:,}" + (" (mean)" if r.get("per_query") else ""),
                    r["planner_plan"],
                    f"{ms(r.get('eval_cold_ms'))} / {ms(r.get('eval_warm_ms'))}",
                    ms(r["planner_p50_ms"]),
                    ms(r["planner_p99_ms"]),
                    f"{ratio(r['planner_p50_ms'], b50)} / {ratio(r['planner_p99_ms'], b99)}",
                    f"{r['planner_recall']:.3f}",
                    r.get("selector_only_plan", "–") if filtered else "–",
                    ms(r.get("selector_only_p50_ms")),
                    ms(r.get("selector_only_p99_ms")),
                    f"{r['selector_only_recall']:.3f}" if filtered else "–",
                    ratio(r["planner_p50_ms"], r.get("selector_only_p50_ms")),
                    ms(r.get("fresh_p50_ms")),
                ]
            )
        params = ", ".join(f"{k} {v}" for k, v in res["search_params"].items()) or "exact"
        parts += [
            f"**{res['factory']}** ({params}; {res['segments']} segment(s); built in "
            f"{res['build_s']:.0f} s; EXACT_SEARCH_MAX {res['exact_search_max']:,})",
            "",
            table(
                [
                    "filter",
                    "allowed",
                    "plan",
                    "filter eval ms cold / warm",
                    "p50 ms",
                    "p99 ms",
                    "p50 / p99 vs unfiltered",
                    "recall@10",
                    "selector-only plan",
                    "selector-only p50 ms",
                    "selector-only p99 ms",
                    "selector-only recall@10",
                    "planner / selector-only p50",
                    "fresh filter p50 ms",
                ],
                rows,
            ),
            "",
        ]
    fallback = [(res["factory"], r) for res in results for r in res["fallback"]]
    if fallback:
        parts += [
            "Filter on a field outside filter_fields (`unindexed_rank`, the same values "
            "as the indexed `rank`): the metadata scan",
            "",
            table(
                [
                    "factory",
                    "filter",
                    "allowed",
                    "plan",
                    "filter eval ms cold / warm",
                    "indexed `rank` eval ms cold",
                    "p50 ms repeated filter",
                    "p99 ms repeated filter",
                    "p50 ms fresh filter",
                    "indexed `rank` fresh p50 ms",
                    "fresh: scan / indexed",
                    "recall@10",
                ],
                [
                    [
                        factory,
                        r["filter"],
                        f"{r['allowed']:,}",
                        r["plan"],
                        f"{ms(r['eval_cold_ms'])} / {ms(r['eval_warm_ms'])}",
                        ms(r.get("indexed_eval_cold_ms")),
                        ms(r["p50_ms"]),
                        ms(r["p99_ms"]),
                        ms(r["fresh_p50_ms"]),
                        ms(r.get("indexed_fresh_p50_ms")),
                        ratio(r["fresh_p50_ms"], r.get("indexed_fresh_p50_ms")),
                        f"{r['recall']:.3f}",
                    ]
                    for factory, r in fallback
                ],
            ),
            "",
        ]
    head = f"N = {n:,}, d = {dim}, k = {K}, {queries} single queries per cell"
    return head + "\n\n" + "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="items (default 200,000; --quick 20,000)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--factories", nargs="+", default=None,
                    help='FAISS factories (default: Flat "IVF1024,Flat"; --quick: Flat '
                    '"IVF128,Flat")')  # fmt: skip
    ap.add_argument("--queries", type=int, default=None, help="single queries per cell (200)")
    ap.add_argument("--fresh-queries", type=int, default=None,
                    help="queries with a new filter each, per rank filter (50)")  # fmt: skip
    ap.add_argument("--fallback", type=float, nargs="*", default=list(FALLBACK_SELECTIVITIES),
                    help="selectivities of the unindexed-field filter (none: skip it)")  # fmt: skip
    ap.add_argument("--fallback-queries", type=int, default=None,
                    help="fresh-filter queries on the unindexed field (5; each scans)")  # fmt: skip
    ap.add_argument("--warm", type=int, default=5, help="untimed searches before each cell")
    ap.add_argument("--eval-repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="FAISS threads of the searches")
    ap.add_argument("--quick", action="store_true", help="a smoke run (N 20,000, fewer queries)")
    ap.add_argument("--workdir", default=None, help="parent of the temporary folder")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    quick = args.quick
    args.n = args.n or (20_000 if quick else 200_000)
    args.factories = args.factories or ["Flat", "IVF128,Flat" if quick else "IVF1024,Flat"]
    args.queries = args.queries or (50 if quick else 200)
    args.fresh_queries = args.fresh_queries if args.fresh_queries is not None else (
        10 if quick else 50)  # fmt: skip
    args.fallback_queries = args.fallback_queries or (2 if quick else 5)
    unknown = [s for s in args.fallback if s not in SELECTIVITIES]
    if unknown:
        ap.error(f"--fallback: choose among {SELECTIVITIES}")
    faiss.omp_set_num_threads(args.threads)
    info: Row = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "nice": os.nice(0),
        "threads": args.threads,
        "faiss": faiss.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "commit": git("rev-parse", "--short", "HEAD"),
        "index/store": "modified" if git("status", "--porcelain", "index/store") else "committed",
        "load_before": load_average(),
    }
    print("  ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    started = time.perf_counter()
    x, cluster = clustered(args.n, args.dim, SEED + 10)
    q, query_cluster = clustered(args.queries, args.dim, SEED + 20)
    fields = catalogue(args.n, cluster)
    measured = cases(fields, query_cluster % CATEGORIES)
    exact = {c.name: reference(x, q, c) for c in measured}
    print(f"data and brute force: {time.perf_counter() - started:.1f} s", flush=True)
    results: list[Row] = []
    work = Path(tempfile.mkdtemp(prefix="filtered_search-", dir=args.workdir))
    try:
        for factory in args.factories:
            results.append(bench_factory(factory, x, fields, q, measured, exact, work, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        info["load_after"] = load_average()
        info["total_s"] = round(time.perf_counter() - started, 1)
        md = markdown(results, args.n, args.dim, args.queries)
        print("\n" + "  ".join(f"{k}: {v}" for k, v in info.items()) + "\n\n" + md)
        if args.json:
            payload = {"n": args.n, "dim": args.dim, "k": K, "queries": args.queries,
                       "fresh_queries": args.fresh_queries, "machine": info,
                       "factories": results}  # fmt: skip
            Path(args.json).write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
