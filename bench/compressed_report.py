"""bench/compressed_search.py's report: its results as Markdown tables, and as JSON
without the per-query hits."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from search_qps import D
from store_scale import table

K = 10
"""The hits a query asks for (recall@10)."""
CORES = os.cpu_count() or 1
Row = dict[str, Any]


def f2(v: float) -> str:
    return f"{v:,.2f}"


def rss_cell(rss: Row, total: str, split: str) -> str:
    """'TOTAL (ANON + FILE)' in MB; the split only where the run recorded it."""
    parts = rss.get(split)
    if not parts:
        return f"{rss[total]:,.0f}"
    return f"{rss[total]:,.0f} ({parts['RssAnon']:,.0f} + {parts['RssFile']:,.0f})"


def markdown(res: Row) -> str:
    facs: dict[str, Row] = res["factories"]
    parts = [f"N = {res['n']:,}, d = {D}, k = {K}, {res['queries']:,} queries"]
    parts += [
        "",
        table(
            ["factory", "build s", "segments", "disk B/vector (FAISS + vectors)",
             "RSS after open MB (anon + file)", "RSS after searches MB (searches)",
             "cold p50 / p99 ms"],
            [
                [
                    r["factory"],
                    f"{r['build_s']:.1f}",
                    str(r["segments"]),
                    f"{r['disk_bytes_per_vector']:,.0f} ({r['faiss_bytes_per_vector']:,.0f} + "
                    f"{r['vectors_bytes_per_vector']:,.0f})",
                    rss_cell(r["rss"], "rss_after_open_mb", "after_open"),
                    rss_cell(r["rss"], "rss_after_searches_mb", "after_searches")
                    + f" ({r['rss']['searches']:,})",
                    (
                        f"{r['cold']['p50_ms']:.2f} / {r['cold']['p99_ms']:.2f}"
                        if "p50_ms" in r.get("cold", {})
                        else "not measured"
                    ),
                ]
                for r in facs.values()
                if "rss" in r and "build_s" in r
            ],
        ),
    ]  # fmt: skip
    sq8 = facs.get("ivf-sq8", {}).get("settings", [])
    sq8_base = next((s for s in sq8 if not s["rescore"]), None)
    rows = []
    for r in facs.values():
        settings = r.get("settings", [])
        for s in settings:
            codes = next(
                (c for c in settings if c["nprobe"] == s["nprobe"] and not c["rescore"]), None
            )
            label = (
                f"x{s['oversample']}" if s["rescore"] else ("off" if r["compressed"] else "exact")
            )
            rows.append(
                [
                    r["factory"],
                    str(s["nprobe"] or "-"),
                    label,
                    f"{s['recall@10']:.3f}",
                    f2(s["p50_ms"]),
                    f2(s["p99_ms"]),
                    f"{s['qps']:,.0f}",
                    f"{s['p50_ms'] / codes['p50_ms']:.2f}x" if codes and r["compressed"] else "",
                    f"{s['p99_ms'] / codes['p99_ms']:.2f}x" if codes and r["compressed"] else "",
                    f"{s['p50_ms'] / sq8_base['p50_ms']:.2f}x" if sq8_base else "",
                ]
            )
    parts += [
        "",
        table(
            ["factory", "nprobe", "re-scoring", "recall@10", "p50 ms", "p99 ms",
             f"QPS ({CORES} cores)", "p50 / same codes without", "p99 / same codes without",
             "p50 / IVF-SQ8 without"],
            rows,
        ),
    ]  # fmt: skip
    refine = facs.get("ivf-pq", {}).get("refine", {})
    if refine.get("settings"):
        store = {(s["nprobe"], s["oversample"]): s for s in facs["ivf-pq"]["settings"]}
        rows = []
        for s in refine["settings"]:
            v = store[(s["nprobe"], s["oversample"])]
            rows.append(
                [
                    str(s["nprobe"]),
                    str(s["oversample"]),
                    f"{v['recall@10']:.3f}",
                    f"{s['recall@10']:.3f}",
                    f"{f2(v['p50_ms'])} / {f2(v['p99_ms'])}",
                    f"{f2(s['p50_ms'])} / {f2(s['p99_ms'])}",
                    f"{v['p50_ms'] / s['p50_ms']:.2f}",
                    f"{v['p99_ms'] / s['p99_ms']:.2f}",
                    f"{v['qps']:,.0f} / {s['qps']:,.0f}",
                    *paired_cells(in_turns(s)),
                    *interleaved_cells(every_query(s)),
                ]
            )
        parts += [
            "",
            table(
                ["nprobe", "oversample = k_factor", "store recall@10", "RefineFlat recall@10",
                 "store p50 / p99 ms", "RefineFlat p50 / p99 ms", "p50 store / RefineFlat",
                 "p99 store / RefineFlat", "QPS store / RefineFlat",
                 "paired in turns: p50 store / RefineFlat ms", "p50 ratio",
                 "p99 ratio", "every-query turns p50 / p99 ratio"],
                rows,
            ),
        ]  # fmt: skip
    tuned = [(r["factory"], r["tuned"]) for r in facs.values() if "tuned" in r]
    if tuned:
        parts += [
            "",
            table(
                ["factory", "target recall@10", "chosen", "tuning recall (own items)",
                 "held-out recall (own items)", "recall on the bench's fresh queries",
                 "fresh p50 / p99 ms", "tune s"],
                [[f, str(t["target_recall"]), str(t["chosen"]), f"{t['tuning_recall']:.4f}",
                  f"{t['held_out_recall']:.4f}", f"{t['fresh_recall']:.4f}",
                  f"{f2(t['fresh_p50_ms'])} / {f2(t['fresh_p99_ms'])}", f"{t['tune_s']:.0f}"]
                 for f, t in tuned],
            ),
        ]  # fmt: skip
    milvus = res.get("milvus", {})
    if milvus.get("index_type"):
        mq = milvus["queries"]
        rows = []
        for name in ("ivf-sq8", "ivf-pq"):
            for s in facs.get(name, {}).get("settings", []):
                default_os = facs[name]["default_params"].get("oversample")
                first = s["nprobe"] == facs[name]["settings"][0]["nprobe"]
                if first and (not s["rescore"] or s["oversample"] == default_os):
                    hits = s.get("hits")  # absent in a --json file: recall over every query
                    rec = float(np.mean(hits[:mq])) / K if hits else s["recall@10"]
                    how = f"rescore x{s['oversample']}" if s["rescore"] else "codes only"
                    rows.append(
                        [
                            f"vitrieval {facs[name]['factory']} {how}, nprobe {s['nprobe']}",
                            f"{rec:.3f}",
                            f"{f2(s['p50_ms'])} / {f2(s['p99_ms'])} (all queries)",
                            f"{facs[name]['rss']['rss_after_open_mb']:,.0f}",
                            f"{facs[name]['disk_bytes_per_vector']:,.0f}",
                        ]
                    )
        rows.append(
            [
                f"Milvus Lite {milvus['index_type']} {milvus['build_params']}, nprobe "
                f"{milvus['nprobe']}",
                f"{milvus['recall@10']:.3f}",
                f"{f2(milvus['search_p50_ms'])} / {f2(milvus['search_p99_ms'])}",
                f"{milvus['rss_after_open_mb']:,.0f}",
                f"{milvus['disk_bytes_per_vector']:,.0f}",
            ]
        )
        parts += [
            "",
            f"Milvus Lite, first {mq} queries:",
            "",
            table(["engine / setting", f"recall@10 ({mq} queries)", "p50 / p99 ms",
                   "RSS after open MB", "disk B/vector"], rows),
        ]  # fmt: skip
    elif milvus:
        parts += ["", f"Milvus Lite: {milvus.get('skipped') or milvus.get('error')}"]
    return "\n".join(parts) + "\n"


def paired_cells(pair: Row | None) -> list[str]:
    """The paired pass's columns (blank in a run that made none)."""
    if not pair:
        return ["", "", ""]
    return [
        f"{f2(pair['a_p50_ms'])} / {f2(pair['b_p50_ms'])}",
        f"{pair['p50_ratio']:.2f}",
        f"{pair['p99_ratio']:.2f}",
    ]


def in_turns(setting: Row) -> Row | None:
    """A RefineFlat setting's paired pass in turns of several queries (None: a run from
    before those, whose "paired" pass took turns every query)."""
    pair = setting.get("paired")
    return pair if pair and "block" in pair else None


def every_query(setting: Row) -> Row | None:
    """A RefineFlat setting's paired pass taking turns every query."""
    pair = setting.get("paired")
    return setting.get("interleaved") or (pair if pair and "block" not in pair else None)


def interleaved_cells(pair: Row | None) -> list[str]:
    """The pass taking turns every query: its ratios (blank in a run that made none)."""
    return [f"{pair['p50_ratio']:.2f} / {pair['p99_ratio']:.2f}"] if pair else [""]


def write_json(res: Row, path: str | None) -> None:
    if not path:
        return
    slim = json.loads(json.dumps(res, default=str))
    for r in slim["factories"].values():  # per-query hits: not needed in the file
        for s in r.get("settings", []) + r.get("refine", {}).get("settings", []):
            s.pop("hits", None)
    Path(path).write_text(json.dumps(slim, indent=2))
