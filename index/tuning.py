"""Search settings tuned to a target recall: `vitrieval-index tune` and `build
--target-recall`.

Recall is measured the way bench/store_scale.py measures it: recall@k = |found ∩ exact|
/ k, averaged over queries. The queries are items of the index itself, drawn at random
(`DEFAULT_TUNING_QUERIES` of them, and as many others held out to check the choice);
each query's own item is left out of both its answer (the search excludes its key) and
its exact neighbours (computed by brute force over every live stored vector, in one
streamed pass).

Two knobs, searched coarse then fine:

- the coarse one, the index's own: IVF `nprobe` (1, 2, 4, ... up to nlist) or HNSW
  `efSearch` (16 ... 1024); it bounds which items can be found at all;
- the fine one, `oversample` (request.py), for indexes that score from compressed codes:
  how many candidates per k are re-scored by their exact vectors.

For each coarse value the ceiling (the largest oversample) is measured first; where it
reaches the target, the least oversample that does is found by bisection (recall grows
with oversample). The coarse value is raised while that makes the cheapest setting
cheaper. Cost is the measured median latency of one query on one FAISS thread on this
machine, so the choice is the setting that reaches the target soonest, not the fewest
codes scanned.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from .store import StoreError
from .store import manifest as mf
from .store.request import MAX_OVERSAMPLE, Query, Where

DEFAULT_TUNING_QUERIES = 1000
"""Queries recall is measured on (and as many held out to check the choice)."""
TUNING_K = 10
OVERSAMPLES = tuple(range(1, MAX_OVERSAMPLE + 1))  # bisected: about 6 trials a coarse value
EF_SEARCHES = (16, 32, 64, 128, 256, 512, 1024)
MIN_TUNING_QUERIES = 20

Report = Callable[[str], None]


@dataclass(frozen=True)
class QuerySample:
    """Queries drawn from the index: their keys, float32 (n, d) vectors, and each one's
    exact top-k keys among the other live items."""

    keys: list[str]
    vectors: np.ndarray
    truth: list[set[str]]


@dataclass(frozen=True)
class Trial:
    """One setting measured: its parameters, recall@k and median single-query latency."""

    params: dict[str, int]
    recall: float
    latency_ms: float


def check_target(target: Any) -> float:
    """`target` as a recall to tune to: a number in (0, 1]."""
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
        raise StoreError(f"the target recall must be a number in (0, 1], got {target!r}")
    return float(target)


def tune(
    store: Any,
    target_recall: float,
    *,
    queries: int = DEFAULT_TUNING_QUERIES,
    k: int = TUNING_K,
    seed: int = 0,
    report: Report | None = None,
) -> mf.TuningEntry:
    """Choose and set the search settings of an opened, writable `store` (IndexStore or
    ShardedStore) that reach `target_recall` at the least latency, and record what was
    measured (`set_tuning`); the caller saves. See the module docstring."""
    target = check_target(target_recall)
    say = report or (lambda _line: None)
    tuning, held_out = draw_samples(store, queries, k, seed)
    say(f"exact neighbours of {len(tuning.keys)} + {len(held_out.keys)} sampled items found")
    settings = store.search_params()
    original = {name: settings[name] for name in ("nprobe", "efSearch") if name in settings}
    compressed = "oversample" in settings
    trials: list[Trial] = []

    def measure(params: dict[str, int], sample: QuerySample = tuning) -> Trial:
        trial = run_trial(store, sample, k, params)
        if sample is tuning:
            trials.append(trial)
            say(
                f"  {format_params(trial.params)}: recall@{k} {trial.recall:.4f}, "
                f"{trial.latency_ms:.2f} ms a query"
            )
        return trial

    try:
        with one_faiss_thread():
            best = choose(measure, coarse_values(settings), compressed, target)
    finally:
        apply(store, original)
    reached = best is not None
    if best is None:  # nothing reached the target: the best recall found, cheapest first
        best = max(trials, key=lambda t: (t.recall, -t.latency_ms))
    with one_faiss_thread():
        check = measure(best.params, held_out)
    apply(store, best.params)
    entry = mf.TuningEntry(
        target_recall=target,
        recall=round(best.recall, 6),
        held_out_recall=round(check.recall, 6),
        k=k,
        queries=len(tuning.keys),
        params=dict(best.params),
        latency_ms=round(best.latency_ms, 4),
        items=len(store),
        reached=reached,
        tuned=mf.now_iso(),
    )
    store.set_tuning(entry)
    return entry


def choose(
    measure: Callable[[dict[str, int]], Trial],
    coarse: tuple[str, Sequence[int]] | None,
    compressed: bool,
    target: float,
) -> Trial | None:
    """The cheapest measured setting whose recall reaches `target` (None: none does)."""
    best: Trial | None = None
    name, values = coarse if coarse else ("", [0])
    for value in values:
        params = {name: value} if name else {}
        if not compressed:
            trial = measure(params)
            if trial.recall >= target:
                return trial  # a larger coarse value only costs more
            continue
        ceiling = measure({**params, "oversample": OVERSAMPLES[-1]})
        if ceiling.recall < target:
            continue  # not even the widest re-scoring reaches it at this coarse value
        trial = least_oversample(measure, params, target, ceiling)
        if best is not None and trial.latency_ms >= best.latency_ms:
            break  # the coarse knob costs more than the oversampling it saves
        best = trial
        if trial.params["oversample"] == OVERSAMPLES[0]:
            break
    return best


def least_oversample(
    measure: Callable[[dict[str, int]], Trial],
    params: dict[str, int],
    target: float,
    ceiling: Trial,
) -> Trial:
    """The setting with the smallest oversample reaching `target`; `ceiling`: the
    largest oversample's trial, which does."""
    low, high = 0, len(OVERSAMPLES) - 1
    found = ceiling
    while low < high:
        middle = (low + high) // 2
        trial = measure({**params, "oversample": OVERSAMPLES[middle]})
        if trial.recall >= target:
            high, found = middle, trial
        else:
            low = middle + 1
    return found


def coarse_values(settings: dict[str, int]) -> tuple[str, list[int]] | None:
    """The coarse knob of an index and the values tried, smallest first."""
    if "nlist" in settings:
        nlist = settings["nlist"]
        values = [1 << i for i in range(nlist.bit_length()) if 1 << i < nlist]
        return "nprobe", [*values, nlist]
    if "efSearch" in settings:
        return "efSearch", list(EF_SEARCHES)
    return None


@contextlib.contextmanager
def one_faiss_thread() -> Iterator[None]:
    """Single queries measured on one FAISS thread, as the benchmarks measure them:
    FAISS parallelises a search over its queries, and for one query its OpenMP
    threads only wait for each other (5x slower on a busy 2-core machine)."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(threads)


def apply(store: Any, params: dict[str, int]) -> None:
    names = {"nprobe": "nprobe", "efSearch": "ef_search", "oversample": "oversample"}
    store.set_search_params(**{names[name]: value for name, value in params.items()})


def run_trial(store: Any, sample: QuerySample, k: int, params: dict[str, int]) -> Trial:
    """recall@k and mean latency of `sample`'s queries, one at a time, at `params`."""
    coarse = {name: value for name, value in params.items() if name != "oversample"}
    if coarse:
        apply(store, coarse)
    oversample = params.get("oversample")
    shared = 0
    took = np.empty(len(sample.keys))
    for i, (key, vector, truth) in enumerate(
        zip(sample.keys, sample.vectors, sample.truth, strict=True)
    ):
        query = Query(vector[None, :], k, Where(exclude_keys=[key]), oversample=oversample)
        started = time.perf_counter()
        [hits] = store.search(query)
        took[i] = time.perf_counter() - started
        shared += len(truth & {hit.key for hit in hits})
    # the median: on a shared machine a few descheduled queries would swing a mean
    return Trial(dict(params), shared / (k * len(sample.keys)), 1000 * float(np.median(took)))


def draw_samples(store: Any, n: int, k: int, seed: int) -> tuple[QuerySample, QuerySample]:
    """Two disjoint samples of up to `n` live items each (tuning, held out), with their
    exact top-k among the other live items (one streamed pass over the vectors)."""
    keys = store.keys()
    n = min(n, (len(keys) - k - 1) // 2)
    if n < MIN_TUNING_QUERIES:
        raise StoreError(
            f"tuning needs at least {2 * MIN_TUNING_QUERIES + k + 1} items "
            f"({MIN_TUNING_QUERIES} queries, as many held out, and {k} neighbours); "
            f"the index has {len(keys)}"
        )
    rng = np.random.default_rng(seed)
    chosen = [keys[i] for i in rng.choice(len(keys), size=2 * n, replace=False)]
    vectors = np.stack([store.get(key).vector for key in chosen]).astype(np.float32)
    truth = exact_neighbours(store, chosen, vectors, k)
    samples = [
        QuerySample(chosen[part], vectors[part], truth[part])
        for part in (slice(0, n), slice(n, 2 * n))
    ]
    return samples[0], samples[1]


def exact_neighbours(
    store: Any, keys: Sequence[str], queries: np.ndarray, k: int
) -> list[set[str]]:
    """Per query (float32 (q, d), the vectors of `keys`), the keys of its exact top k
    by inner product among the live items other than its own."""
    best_scores = np.full((len(queries), k + 1), -np.inf, dtype=np.float32)
    best_keys = np.full((len(queries), k + 1), "", dtype=object)
    for batch_keys, vectors in store.live_vectors():
        scores = queries @ vectors.T
        width = min(k + 1, scores.shape[1])
        part = np.argpartition(-scores, width - 1, axis=1)[:, :width]
        names = np.asarray(batch_keys, dtype=object)
        all_scores = np.concatenate([best_scores, np.take_along_axis(scores, part, 1)], axis=1)
        all_keys = np.concatenate([best_keys, names[part]], axis=1)
        top = np.argsort(-all_scores, axis=1, kind="stable")[:, : k + 1]
        best_scores = np.take_along_axis(all_scores, top, 1)
        best_keys = np.take_along_axis(all_keys, top, 1)
    return [
        set([name for name in row if name and name != own][:k])
        for own, row in zip(keys, best_keys.tolist(), strict=True)
    ]


def format_params(params: dict[str, int]) -> str:
    return ", ".join(f"{name} {value}" for name, value in params.items()) or "as it is"
