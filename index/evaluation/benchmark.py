"""Offline benchmark: embed a labelled set, index it, measure quality and speed.

What `vitrieval-index bench` runs. Quality comes from `vitrieval.index.evaluation.metrics` on the
embeddings (exact ranking, so the numbers describe the model, not the index type);
for an approximate FAISS factory the report adds its recall@10 against exact search,
which is what the index type costs in quality. Speed: embedding images/s (decode +
preprocess + model, the whole pipeline) and search queries/s of the index.

Protocols: with only a gallery, leave-one-out within it; with a query set, queries
against the gallery. A dataset name uses its held-out split as the gallery
(leave-one-out), the standard protocol for CUB, Cars and SOP. Copy detection
(`run_copy_detection`): a folder of photos is the gallery (plus distractors), edited
copies of each photo (`vitrieval.index.evaluation.copy_detection`) are the queries, and each
query's one
relevant item is its original (`vitrieval.index.evaluation.metrics.target_ranks`); with
`relevant="label"`
the photos sharing its original's label (versions of one design) are relevant too.

Re-ranking (`rerank=("aqe", "dba", "dba+aqe")`, `vitrieval.index.rerank`): the report gains
`rerank`, the same quality metrics for the plain exact search ("none") and for each
re-ranked one side by side (plus the seconds the re-ranking took), and
`rerank_settings` (n and alpha). They are exact too: neighbours and rankings over the
whole gallery, whatever the factory. Without `rerank` the report is as before.
"""

from __future__ import annotations

import csv
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..rerank import RerankSettings, leave_one_out_metrics, rerank_vectors
from ..runtime.embedder import Embedder, EmbedResult
from ..store import IndexStore
from .copy_detection import (
    DEFAULT_PER_IMAGE,
    KINDS,
    CopySession,
    copy_filename,
    copy_queries,
    describe,
)
from .datasets import DatasetError, Item
from .metrics import query_metrics, retrieval_metrics, target_metrics, target_ranks

DEFAULT_KS = (1, 2, 4, 8)
RELEVANT_MODES = ("original", "label")
"""Copy detection: what a copy's relevant gallery items are (`run_copy_detection`)."""
SOP_KS = (1, 10, 100, 1000)
FIDELITY_K = 10


def _embed(
    embedder: Embedder, items: Sequence[Item], what: str
) -> tuple[np.ndarray, list, int, float]:
    """(embeddings, labels, unreadable count, images/s); an error if none is readable."""
    result, seconds, _ = _timed_embed(embedder, items)
    if not result.indices:
        first = f" (first: {result.errors[0][1]})" if result.errors else ""
        raise DatasetError(f"none of the {len(items)} {what} images could be read{first}")
    labels = [items[i].label for i in result.indices]
    return result.embeddings, labels, len(result.errors), len(items) / max(seconds, 1e-9)


def _timed_embed(embedder: Embedder, items: Sequence[Item]) -> tuple[EmbedResult, float, float]:
    """`embedder.embed_items(items)` with the seconds it took, in all and in the model
    (0 for an embedder that does not count its `model_seconds`)."""
    model_before = getattr(embedder, "model_seconds", 0.0)
    started = time.perf_counter()
    result = embedder.embed_items(items, progress=True)
    seconds = time.perf_counter() - started
    return result, seconds, getattr(embedder, "model_seconds", 0.0) - model_before


def _exact_top_k(
    queries: np.ndarray, gallery: np.ndarray, k: int, leave_one_out: bool, chunk: int = 1024
) -> np.ndarray:
    """Exact top-k gallery ids per query, (Q, k), in chunks of queries (bounded memory)."""
    rows = []
    for start in range(0, len(queries), chunk):
        scores = queries[start : start + chunk] @ gallery.T
        if leave_one_out:
            own = np.arange(start, start + len(scores))
            scores[np.arange(len(scores)), own] = -np.inf
        # stable sort on the negated scores keeps the ascending-index tie rule
        rows.append(np.argsort(-scores, axis=1, kind="stable")[:, :k])
    return np.concatenate(rows)


def _index_measurements(
    gallery: np.ndarray, queries: np.ndarray, factory: str, leave_one_out: bool
) -> dict[str, float]:
    """Build `factory` over the gallery; time the search; compare with exact search."""
    k = min(FIDELITY_K, len(gallery) - (1 if leave_one_out else 0))
    with tempfile.TemporaryDirectory() as tmp:
        store = IndexStore.create(Path(tmp) / "index", dim=gallery.shape[1], factory=factory)
        if store.needs_training():
            store.train(gallery)
        keys = [str(i) for i in range(len(gallery))]
        store.add(keys, gallery)
        fetch = k + 1 if leave_one_out else k
        started = time.perf_counter()
        hits = store.search(queries, fetch)
        qps = len(queries) / max(time.perf_counter() - started, 1e-9)
        store.save()
        files = [p for p in (Path(tmp) / "index").iterdir() if p.suffix != ".onnx"]
        index_bytes = sum(p.stat().st_size for p in files)
        faiss_bytes = sum(p.stat().st_size for p in files if p.suffix == ".faiss")
    # index_bytes includes the SQLite item table, which keeps every float32 vector;
    # faiss_bytes is what the index type itself costs.
    measured = {
        "search_qps": qps,
        "index_bytes": index_bytes,
        "faiss_bytes": faiss_bytes,
        "index_factory": factory,
    }
    if factory != "Flat" and k > 0:
        exact = _exact_top_k(queries, gallery, k, leave_one_out)
        overlap = []
        for row, (query_hits, truth) in enumerate(zip(hits, exact, strict=True)):
            found = [int(h.key) for h in query_hits if not (leave_one_out and int(h.key) == row)]
            overlap.append(len(set(found[:k]) & set(truth.tolist())) / k)
        measured[f"recall@{k}_vs_exact"] = float(np.mean(overlap))
    return measured


def run_benchmark(
    embedder: Embedder,
    gallery: Sequence[Item],
    queries: Sequence[Item] | None = None,
    *,
    ks: Sequence[int] = DEFAULT_KS,
    factory: str = "Flat",
    name: str = "",
    rerank: Sequence[str] = (),
    rerank_settings: RerankSettings | None = None,
) -> dict:
    """Everything `report.json` holds; see the module docstring for the protocol (and
    for `rerank`, the re-rankings measured beside the plain search)."""
    gallery_vectors, gallery_labels, gallery_failed, embed_rate = _embed(
        embedder, gallery, "gallery"
    )
    report: dict = {"dataset": name, "model_fingerprint": embedder.fingerprint, "dim": embedder.dim}
    if queries is None:
        scores = retrieval_metrics(gallery_vectors, gallery_labels, ks=ks)
        query_vectors, failed = gallery_vectors, gallery_failed
        protocol = "leave-one-out"
    else:
        query_vectors, query_labels, query_failed, _ = _embed(embedder, queries, "query")
        scores = retrieval_metrics(
            query_vectors,
            query_labels,
            ks=ks,
            gallery_embeddings=gallery_vectors,
            gallery_labels=gallery_labels,
        )
        failed = gallery_failed + query_failed
        protocol = "queries-vs-gallery"
    if scores["n_queries"] == 0:
        other = "another gallery image" if queries is None else "a gallery image"
        raise DatasetError(
            f"no query has {other} of its label ({scores['n_dropped']} queries, "
            f"{len(set(gallery_labels))} labels): there is nothing to measure"
        )
    report.update(
        protocol=protocol,
        n_gallery=len(gallery_vectors),
        unreadable_images=failed,
        embed_images_per_s=embed_rate,
        **scores,
    )
    report.update(
        _index_measurements(gallery_vectors, query_vectors, factory, leave_one_out=queries is None)
    )
    if rerank:

        def score(q: np.ndarray, g: np.ndarray) -> dict:
            if queries is None:
                return leave_one_out_metrics(q, g, gallery_labels, ks).summary()
            return retrieval_metrics(
                q, query_labels, ks=ks, gallery_embeddings=g, gallery_labels=gallery_labels
            )

        report.update(
            _rerank_report(
                scores,
                query_vectors,
                gallery_vectors,
                rerank,
                rerank_settings,
                score,
                leave_one_out=queries is None,
            )
        )
    return report


def _rerank_report(
    scores: dict,
    queries: np.ndarray,
    gallery: np.ndarray,
    methods: Sequence[str],
    settings: RerankSettings | None,
    score: Callable[[np.ndarray, np.ndarray], dict],
    *,
    leave_one_out: bool,
) -> dict:
    """`rerank_settings` and `rerank`: the plain search's metrics ("none") and each
    method's, `score(query vectors, gallery vectors)` on its re-ranked vectors."""
    settings = settings or RerankSettings()
    counts = ("n_queries", "n_dropped", "n_labels")
    rows = {"none": {k: v for k, v in scores.items() if k not in counts}}
    found = rerank_vectors(queries, gallery, methods, settings, leave_one_out=leave_one_out)
    for method, (q, g, seconds) in found.items():
        measured = score(q, g)
        rows[method] = {k: v for k, v in measured.items() if k not in counts}
        rows[method]["seconds"] = seconds
    return {"rerank_settings": asdict(settings), "rerank": rows}


def run_copy_detection(
    embedder: Embedder,
    photos: Sequence[Item],
    distractors: Sequence[Item] = (),
    *,
    per_image: int = DEFAULT_PER_IMAGE,
    seed: int = 0,
    kinds: Sequence[str] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    factory: str = "Flat",
    name: str = "",
    relevant: str = "original",
    rerank: Sequence[str] = (),
    rerank_settings: RerankSettings | None = None,
    save_copies: Path | None = None,
    ranks_path: Path | None = None,
) -> dict:
    """Copy-detection benchmark: `photos` + `distractors` are the gallery (in that
    order), `per_image` edited copies of every readable photo are the queries.

    Metrics are exact over the whole gallery (`target_ranks`: an exact score tie goes to
    the lower gallery index, so an original beats a byte-identical distractor).
    Photos or distractors that cannot be decoded are left out and listed under
    `unreadable`; no copies are made of an unreadable photo. `kinds` forces every
    copy's edits (None: the random composition of `vitrieval.index.evaluation.copy_detection`).

    `relevant="original"`: a copy's one relevant item is its original. `"label"`: every
    photo with its original's `label` is relevant too (versions of one design in one
    folder), scored with `vitrieval.index.evaluation.metrics.query_metrics`; a photo without a
    label is its
    own design, and distractors are never relevant.

    `rerank`: the same metrics after each re-ranking (module docstring); DBA augments
    the whole gallery, distractors included, and the copies are the queries.

    `save_copies`: a folder that receives every copy as a PNG file
    (`vitrieval.index.evaluation.copy_detection.copy_filename`). `ranks_path`: a CSV written with
    one row per
    embedded copy (`write_ranks`). Each photo is decoded once for all its copies; the
    report's `*_seconds` entries say where the time went.
    """
    if relevant not in RELEVANT_MODES:
        raise ValueError(f"relevant must be one of {RELEVANT_MODES}; got {relevant!r}")
    gallery = [*photos, *distractors]
    embedded, gallery_seconds, gallery_model = _timed_embed(embedder, gallery)
    embed_rate = len(gallery) / max(gallery_seconds, 1e-9)
    unreadable = [
        {"key": str(gallery[pos].path or gallery[pos].key), "reason": reason}
        for pos, reason in embedded.errors
    ]
    row_of = {pos: row for row, pos in enumerate(embedded.indices)}
    originals = [p for p in range(len(photos)) if p in row_of]
    if not originals:
        raise DatasetError(
            f"none of the {len(photos)} photos could be decoded (first: {unreadable[0]['reason']})"
        )

    session = CopySession(per_image, save_copies)
    queries = copy_queries([photos[p] for p in originals], per_image, seed, kinds, session)
    made, copies_seconds, copies_model = _timed_embed(embedder, queries)
    query_rate = len(queries) / max(copies_seconds, 1e-9)
    # a photo decoded for the gallery should decode again; if not, say so, do not crash
    unreadable += [{"key": queries[pos].key, "reason": reason} for pos, reason in made.errors]
    if not made.indices:
        raise DatasetError(f"no copy could be made (first: {made.errors[0][1]})")
    targets = np.repeat([row_of[p] for p in originals], per_image)[made.indices]
    query_kinds = [queries[pos].kinds for pos in made.indices]
    if ranks_path is not None:
        write_ranks(
            ranks_path,
            [queries[pos] for pos in made.indices],
            target_ranks(made.embeddings, embedded.embeddings, targets),
            np.einsum("qd,qd->q", made.embeddings, embedded.embeddings[targets]),
            saved=save_copies is not None,
        )
    if relevant == "label":
        scores, by_kind = _label_scores(embedded, made.embeddings, targets, photos, query_kinds, ks)
    else:
        ranks = target_ranks(made.embeddings, embedded.embeddings, targets)
        scores = target_metrics(ranks, ks)
        by_kind = {}
        for kind in KINDS:
            mask = np.array([kind in chosen for chosen in query_kinds])
            if mask.any():
                part = target_metrics(ranks[mask], (1,))
                by_kind[kind] = {k: part[k] for k in ("n_queries", "recall@1", "map")}

    n_distractors = sum(1 for pos in embedded.indices if pos >= len(photos))
    report: dict = {
        "dataset": name,
        "protocol": "copy-detection",
        "model_fingerprint": embedder.fingerprint,
        "dim": embedder.dim,
        "seed": seed,
        "queries_per_image": per_image,
        "relevant": relevant,
        "n_originals": len(originals),
        "n_distractors": n_distractors,
        "n_gallery": len(embedded.indices),
        "unreadable_images": len(unreadable),
        **scores,
        "embed_images_per_s": embed_rate,
        "query_images_per_s": query_rate,
        # the pipeline overlaps decoding (threads) with the model, so wall times are
        # given beside the summed thread times of each part
        "gallery_seconds": gallery_seconds,
        "gallery_model_seconds": gallery_model,
        "copies_seconds": copies_seconds,
        "copies_model_seconds": copies_model,
        "copies_photo_decodes": session.decodes,
        "copies_decode_seconds": session.decode_seconds,
        "copies_edit_seconds": session.edit_seconds,
        "copies_save_seconds": session.save_seconds,
    }
    if save_copies is not None:
        report["copies_dir"] = str(save_copies)
    if ranks_path is not None:
        report["ranks_file"] = str(ranks_path)
    report.update(
        _index_measurements(embedded.embeddings, made.embeddings, factory, leave_one_out=False)
    )
    report.update(
        by_transform=by_kind,
        query_generation=describe(seed, per_image, kinds),
        unreadable=unreadable,
    )
    if rerank:

        def score(q: np.ndarray, g: np.ndarray) -> dict:
            if relevant == "label":
                again = replace(embedded, embeddings=g)
                return _label_scores(again, q, targets, photos, query_kinds, ks)[0]
            return target_metrics(target_ranks(q, g, targets), ks)

        report.update(
            _rerank_report(
                scores,
                made.embeddings,
                embedded.embeddings,
                rerank,
                rerank_settings,
                score,
                leave_one_out=False,
            )
        )
    return report


RANKS_COLUMNS = ("query", "copy_file", "original", "rank", "score", "edits")
"""The columns of the copy-detection ranks CSV (`write_ranks`)."""


def write_ranks(
    path: Path,
    queries: Sequence,
    ranks: np.ndarray,
    scores: np.ndarray,
    *,
    saved: bool,
) -> None:
    """One CSV row per embedded copy: its query key, its file below the copies folder
    (empty when copies are not saved), its original's key, the original's rank (1-based,
    exact over the whole gallery, `vitrieval.index.evaluation.metrics.target_ranks`) and the cosine
    score
    between copy and original, and its edits (``crop+jpeg``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(RANKS_COLUMNS)
        for query, rank, score in zip(queries, ranks.tolist(), scores.tolist(), strict=True):
            copy_file = copy_filename(query.key) if saved else ""
            edits = "+".join(query.kinds)
            writer.writerow((query.key, copy_file, query.source, rank, f"{score:.6f}", edits))


def _label_scores(
    embedded: EmbedResult,
    query_vectors: np.ndarray,
    targets: np.ndarray,
    photos: Sequence[Item],
    query_kinds: list[tuple[str, ...]],
    ks: Sequence[int],
) -> tuple[dict, dict]:
    """Copy-detection metrics with every gallery photo of the original's label relevant:
    (scores, by_kind). Gallery rows get a class per label; a photo without a label, and
    every distractor, a class of its own."""
    classes: dict[object, int] = {}
    gallery_classes = []
    for pos in embedded.indices:
        label = photos[pos].label if pos < len(photos) else None
        own = ("label", label) if label is not None else ("item", pos)
        gallery_classes.append(classes.setdefault(own, len(classes)))
    gallery_classes = np.asarray(gallery_classes, dtype=np.int64)
    per_query = query_metrics(
        query_vectors,
        gallery_classes[targets],
        ks,
        gallery_embeddings=embedded.embeddings,
        gallery_labels=gallery_classes,
    )
    # the original is always in the gallery, so no query is dropped
    summary = per_query.summary()
    scores = {k: v for k, v in summary.items() if k not in ("n_queries", "n_dropped")}
    scores["median_rank"] = float(np.median(per_query.first_rank))
    scores["n_queries"] = summary["n_queries"]
    scores["n_labels"] = len(set(gallery_classes[targets].tolist()))
    by_kind = {}
    for kind in KINDS:
        mask = np.array([kind in chosen for chosen in query_kinds])
        if mask.any():
            by_kind[kind] = {
                "n_queries": int(mask.sum()),
                "recall@1": float(np.mean(per_query.first_rank[mask] == 1)),
                "map": float(np.mean(per_query.ap[mask])),
            }
    return scores, by_kind


def write_report(report: dict, out: Path) -> None:
    """REPORT/report.json and a Markdown table, REPORT/report.md (and below it, with
    `rerank`, the re-ranked metrics side by side)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps(_json_safe(report), indent=2))
    rows = "\n".join(f"| {key} | {_fmt(value)} |" for key, value in report.items())
    text = f"| metric | value |\n|---|---|\n{rows}\n"
    if report.get("rerank"):
        header, *lines = _rerank_rows(report)
        table = [header, ["---"] * len(header), *lines]
        text += f"\n{_rerank_caption(report)}:\n\n"
        text += "".join(f"| {' | '.join(cells)} |\n" for cells in table)
    atomic_write_text(out / "report.md", text)


def _rerank_rows(report: dict) -> list[list[str]]:
    """Header and one row per re-ranking ("none" first) of the side-by-side table:
    recall@K, map, map_at_r and seconds (report.json has every metric)."""
    rows = report["rerank"]
    shown = ("map", "map_at_r")
    keys = [k for k in rows["none"] if k.startswith("recall@") or k in shown] + ["seconds"]
    out = [["re-ranking", *keys]]
    for method, values in rows.items():
        out.append([method, *(_fmt(values[k]) if k in values else "-" for k in keys)])
    return out


def _rerank_caption(report: dict) -> str:
    """What the re-rankings of the table were run with."""
    settings, used = report["rerank_settings"], "+".join(report["rerank"])
    parts = [
        f"{part} n={settings[f'{part}_neighbours']} alpha={settings[f'{part}_alpha']:g}"
        for part in ("aqe", "dba")
        if part in used.split("+")
    ]
    return f"exact search re-ranked ({'; '.join(parts)})"


def format_rerank(report: dict) -> str:
    """The re-ranked metrics beside the plain search's, one line per re-ranking."""
    table = _rerank_rows(report)
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = [f"{_rerank_caption(report)}:"]
    for row in table:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_table(report: dict) -> str:
    width = max(len(key) for key in report)
    return "\n".join(f"{key.ljust(width)}  {_fmt(value)}" for key, value in report.items())


def _fmt(value: object) -> str:
    if isinstance(value, dict | list):
        return f"{len(value)} entries (see report.json)" if value else "none"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _json_safe(report: dict) -> dict:
    return {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in report.items()}
