"""`vitrieval-train analyze`: the geometry of an embedding space, as LaCViT analyses it.

LaCViT's "Discussion" section looks at a model's embeddings of a labelled set three
ways, and so does this command, on the held-out split of a dataset:

- the distributions of cosine similarity of positive pairs (same class) and negative
  pairs (different classes), every unordered pair of items once (its Figure 2):
  DIR/similarity.png;
- a 2-D t-SNE (its Figure 3) or PCA of the embeddings, one colour per class:
  DIR/projection.png;
- the isotropy score IS = min_c Z(c) / max_c Z(c) of Mu & Viswanath (its Table 3, read
  as in docs/papers.md, reading 3; `vitrieval.index.evaluation.metrics.isotropy_score`) of the
  embeddings as
  they are, printed and written with the mean positive / negative cosine and
  leave-one-out retrieval metrics to DIR/analysis.json; also `isotropy_centered`, the
  score after removing the mean embedding and re-normalising.

Models: a run folder (its model.safetensors), a weights file inside a run folder (e.g.
RUN/initial.safetensors, the encoder before `fit --method lacvit | ce` trained it),
both embedded with PyTorch, or an exported .onnx embedded with ONNX Runtime
(`vitrieval.index.runtime.embedder.Embedder`). Several models (`--model A --model B`, or `--compare
B`)
are drawn side by side, one panel each, in the order given: before, then after.
The dataset options default to the first run's own (its dataset, split and seed), so
the held-out split is the one that run never trained on.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vitrieval.index.atomic import atomic_path, atomic_write_text
from vitrieval.index.cli.arguments import Subcommands
from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.evaluation.metrics import isotropy_score, retrieval_metrics

from .config import ConfigError, FitConfig, dataset_split
from .run_folder import CONFIG_FILE, RUN_MODEL_FILE, read_config, show_metric

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DATASET_OPTIONS = ("dataset", "data_root", "val", "split", "test_fraction", "seed")


class AnalysisError(ConfigError):
    """A model or option `analyze` cannot use; the message says which."""


@dataclass
class ModelRef:
    """Where a model's weights come from: a run's config + a weights file, or an .onnx."""

    name: str
    path: Path
    kind: str  # "run" or "onnx"
    config: FitConfig | None = None
    weights: Path | None = None


@dataclass
class Embedded:
    """A model's embeddings (N, D) of the held-out items, their labels, and scores."""

    ref: ModelRef
    embeddings: np.ndarray
    labels: list[str]


def resolve_model(spec: str, name: str | None = None) -> ModelRef:
    """A run folder, a .safetensors file in a run folder, or an .onnx file -> ModelRef."""
    path = Path(spec)
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise AnalysisError(f"{path} is not a run folder (no {CONFIG_FILE})")
        run, weights, label = path, path / RUN_MODEL_FILE, path.name
    elif path.suffix == ".onnx":
        if not path.is_file():
            raise AnalysisError(f"model file not found: {path}")
        return ModelRef(name or path.stem, path, "onnx")
    elif path.suffix == ".safetensors":
        run, weights, label = path.parent, path, f"{path.parent.name}/{path.stem}"
        if not (run / CONFIG_FILE).is_file():
            raise AnalysisError(f"{path} does not lie in a run folder (no {run / CONFIG_FILE})")
    else:
        raise AnalysisError(
            f"--model {spec}: expected a run folder, a .safetensors file in one, or an .onnx file"
        )
    if not weights.is_file():
        raise AnalysisError(f"no weights at {weights}")
    config = read_config(run)
    return ModelRef(name or label, path, "run", config.resolved(), weights)


def _held_out(args: argparse.Namespace, image_size: int) -> list[Item]:
    split = dataset_split(args, image_size)
    items = list(split.test)
    if not items:
        raise AnalysisError(
            f"{split.name} holds nothing out (--test-fraction 0): give --val or --test-fraction"
        )
    if args.max_items and len(items) > args.max_items:
        # a seeded subset: pairs grow as N^2 and t-SNE is slow beyond a few thousand
        keep = np.random.default_rng(args.seed).choice(len(items), args.max_items, replace=False)
        items = [items[i] for i in sorted(keep)]
    return items


def embed(ref: ModelRef, args: argparse.Namespace) -> Embedded:
    """Embed the held-out split with one model: PyTorch for runs, ONNX Runtime for .onnx."""
    if ref.kind == "onnx":
        from vitrieval.index.runtime.embedder import Embedder

        embedder = Embedder(ref.path, device="cpu" if args.device == "cpu" else "auto")
        items = _held_out(args, embedder.input_size)
        result = embedder.embed_items(items)
        labels = [str(items[i].label) for i in result.indices]
        return Embedded(ref, result.embeddings.astype(np.float32), labels)

    import torch

    from .checkpoint import load_model_weights
    from .data import build_transforms
    from .device import pick_device
    from .evaluate import embed_items
    from .run_folder import model_from_config

    assert ref.config is not None and ref.weights is not None
    model = model_from_config(ref.config, load_pretrained=False)
    load_model_weights(model, ref.weights)
    device = pick_device(args.device)
    model = model.to(device).eval()
    data_config = model.data_config()
    items = _held_out(args, int(data_config["input_size"][-1]))
    _, eval_tf = build_transforms(data_config, 1.0, 0.0, None)
    with torch.no_grad():
        embeddings = embed_items(model, items, eval_tf, args.batch_size, device)
    return Embedded(ref, embeddings, [str(item.label) for item in items])


def pair_cosines(embeddings: np.ndarray, labels: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Cosines of every unordered pair i < j: (positive pairs, negative pairs), 1-D each."""
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    sims = unit @ unit.T  # (N, N)
    codes = np.unique(np.asarray(labels), return_inverse=True)[1]
    i, j = np.triu_indices(len(labels), k=1)
    same = codes[i] == codes[j]
    values = sims[i, j]
    return values[same], values[~same]


def centered(embeddings: np.ndarray) -> np.ndarray:
    """Embeddings (N, D) minus their mean, re-normalised: Mu & Viswanath's first
    post-processing step. The isotropy score of raw embeddings is dominated by a common
    mean direction (a set in a narrow cone around unit u, v . u ~ m for every v, has
    Z(-u) / Z(u) ~ exp(-2m)); this shows what is left."""
    x = embeddings.astype(np.float64) - embeddings.mean(axis=0, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def summarize(emb: Embedded) -> dict:
    """analysis.json's entry for one model."""
    pos, neg = pair_cosines(emb.embeddings, emb.labels)
    scores = retrieval_metrics(emb.embeddings, emb.labels, ks=(1,))
    nan_free = {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in scores.items()}
    return {
        "name": emb.ref.name,
        "model": str(emb.ref.path),
        "kind": emb.ref.kind,
        "n_items": len(emb.labels),
        "embedding_dim": int(emb.embeddings.shape[1]),
        "isotropy": isotropy_score(emb.embeddings.astype(np.float64)),
        "isotropy_centered": isotropy_score(centered(emb.embeddings)),
        "mean_positive_cosine": float(pos.mean()) if pos.size else None,
        "mean_negative_cosine": float(neg.mean()) if neg.size else None,
        "n_positive_pairs": int(pos.size),
        "n_negative_pairs": int(neg.size),
        "recall@1": nan_free["recall@1"],
        "map": nan_free["map"],
        "map_at_r": nan_free["map_at_r"],
    }


def _figure(n_panels: int, sharex: bool = False):
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1,
        n_panels,
        figsize=(4.6 * n_panels, 4.0),
        constrained_layout=True,
        squeeze=False,
        sharex=sharex,
    )
    return plt, fig, list(axes[0])


def _save(plt, fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def plot_similarity(models: list[Embedded], summaries: list[dict], path: Path) -> Figure:
    """One panel per model: density histograms of positive vs negative pair cosines.

    The panels share one x range and one set of bins, so that they compare by eye: the
    range of every model's cosines together, not a fixed -1..1, on which an untrained
    encoder's cosines (often all within 0.99..1) would be a single bar. Returns the
    (closed) figure.
    """
    plt, fig, axes = _figure(len(models), sharex=True)
    pairs = [pair_cosines(emb.embeddings, emb.labels) for emb in models]
    every = np.concatenate([c for pos_neg in pairs for c in pos_neg])
    low, high = (float(every.min()), float(every.max())) if every.size else (-1.0, 1.0)
    pad = max(1e-4, 0.02 * (high - low))
    bins = np.linspace(low - pad, high + pad, 61)
    for ax, (pos, neg), summary in zip(axes, pairs, summaries, strict=True):
        ax.hist(pos, bins=bins, density=True, alpha=0.6, color="tab:blue", label="positive pairs")
        ax.hist(neg, bins=bins, density=True, alpha=0.6, color="tab:orange", label="negative pairs")
        ax.set(
            title=f"{summary['name']}\nisotropy {summary['isotropy']:.3f}",
            xlabel="cosine similarity",
            ylabel="density",
        )
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_xlim(bins[0], bins[-1])  # shared by every panel
    _save(plt, fig, path)
    return fig


def project_2d(embeddings: np.ndarray, method: str, seed: int) -> np.ndarray:
    """(N, D) -> (N, 2) by t-SNE (perplexity 30, PCA initialisation) or PCA."""
    if method == "pca" or len(embeddings) < 5:
        from sklearn.decomposition import PCA

        return PCA(n_components=2, random_state=seed).fit_transform(embeddings)
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    perplexity = min(30.0, (len(embeddings) - 1) / 3)
    tsne = TSNE(2, perplexity=perplexity, init="pca", random_state=seed)
    # One OpenMP thread: on a busy 2-core machine the threads of sklearn's t-SNE wait
    # for each other (a 20-point map took 25-40 s instead of 0.05 s); single-threaded,
    # 3,000 points take seconds.
    with threadpool_limits(limits=1, user_api="openmp"):
        return tsne.fit_transform(embeddings.astype(np.float64))


def plot_projection(
    models: list[Embedded], summaries: list[dict], path: Path, method: str, seed: int
) -> None:
    """One panel per model: the 2-D projection of the embeddings, one colour per class."""
    plt, fig, axes = _figure(len(models))
    classes = sorted({label for emb in models for label in emb.labels})
    if len(classes) <= 20:
        cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
        colour = {name: cmap(i) for i, name in enumerate(classes)}
    else:
        cmap = plt.get_cmap("hsv")
        colour = {name: cmap(i / len(classes)) for i, name in enumerate(classes)}
    for ax, emb, summary in zip(axes, models, summaries, strict=True):
        xy = project_2d(emb.embeddings, method, seed)
        for name in classes:
            mask = np.array([label == name for label in emb.labels])
            if mask.any():
                ax.scatter(*xy[mask].T, s=6, color=colour[name], label=name)
        title = "t-SNE" if method == "tsne" else "PCA"
        ax.set(title=f"{summary['name']}\n{title}, R@1 {summary['recall@1']:.3f}")
        ax.set_xticks([])
        ax.set_yticks([])
    if len(classes) <= 20:
        axes[-1].legend(
            loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, markerscale=2, frameon=False
        )
    _save(plt, fig, path)


def _dataset_defaults(args: argparse.Namespace, refs: list[ModelRef]) -> None:
    """Fill unset dataset options from the first run's config (its own held-out split)."""
    run_cfg = next((ref.config for ref in refs if ref.config is not None), None)
    for option in DATASET_OPTIONS:
        if getattr(args, option) is None and run_cfg is not None:
            setattr(args, option, getattr(run_cfg, option))
    if args.dataset is None:
        raise AnalysisError("--dataset is required when no model is a run folder")
    if args.test_fraction is None:
        args.test_fraction = 0.3
    if args.seed is None:
        args.seed = 0


def analyze(args: argparse.Namespace) -> dict:
    """Embed, score and plot; returns what DIR/analysis.json holds."""
    if args.max_items is not None and args.max_items < 2:
        raise AnalysisError(f"--max-items must be >= 2, got {args.max_items}")
    specs = [*(args.model or []), *(args.compare or [])]
    if not specs:
        raise AnalysisError("give at least one --model")
    names = args.names.split(",") if args.names else [None] * len(specs)
    if len(names) != len(specs):
        raise AnalysisError(f"--names has {len(names)} names for {len(specs)} models")
    refs = [resolve_model(spec, name) for spec, name in zip(specs, names, strict=True)]
    _dataset_defaults(args, refs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [embed(ref, args) for ref in refs]
    for emb in models:
        if len(emb.labels) < 2 or len(set(emb.labels)) < 2:
            raise AnalysisError(f"{emb.ref.name}: the held-out split needs 2 classes or more")
    summaries = [summarize(emb) for emb in models]
    plot_similarity(models, summaries, out / "similarity.png")
    plot_projection(models, summaries, out / "projection.png", args.projection, args.seed)
    report = {
        "dataset": args.dataset,
        "split": args.split,
        "seed": args.seed,
        "projection": args.projection,
        "models": summaries,
    }
    atomic_write_text(out / "analysis.json", json.dumps(report, indent=2) + "\n")
    return report


def run_analyze(args: argparse.Namespace) -> int:
    """CLI handler: prints one line per model and a summary line."""
    report = analyze(args)
    for s in report["models"]:
        print(
            f"{s['name']}: isotropy {s['isotropy']:.4f} (centred {s['isotropy_centered']:.4f})  "
            f"mean cosine positive {show_metric(s['mean_positive_cosine'])} "
            f"negative {show_metric(s['mean_negative_cosine'])}  "
            f"R@1 {show_metric(s['recall@1'])}  ({s['n_items']} held-out images)"
        )
    out = Path(args.out)
    print(
        f"wrote {out / 'similarity.png'}, {out / 'projection.png'} and {out / 'analysis.json'} "
        f"({len(report['models'])} model{'s' if len(report['models']) > 1 else ''})"
    )
    return 0


def add_analyze_parser(sub: Subcommands) -> None:
    """The `analyze` subcommand of vitrieval-train."""
    p = sub.add_parser(
        "analyze",
        help="plot and score the geometry of a model's embeddings",
        description="Embed a dataset's held-out split; write similarity.png (positive vs "
        "negative pair cosines), projection.png (t-SNE or PCA by class) and analysis.json "
        "(isotropy score, mean cosines, R@1). Several models are drawn side by side.",
    )
    p.add_argument(
        "--model",
        action="append",
        help="run folder, RUN/*.safetensors, or .onnx file (repeat to compare)",
    )
    p.add_argument("--compare", action="append", help="another model, drawn after --model")
    p.add_argument("--names", help="comma-separated panel titles, one per model")
    p.add_argument("--out", required=True, help="folder for the PNGs and analysis.json")
    p.add_argument("--dataset", help="dataset name (default: the first run's)")
    p.add_argument("--data-root", dest="data_root", help="dataset folder or CSV file")
    p.add_argument("--val", help="validation folder or CSV to embed (default: the first run's)")
    p.add_argument("--split", help="stratified | disjoint (default: the first run's)")
    p.add_argument("--test-fraction", dest="test_fraction", type=float, help="held-out share")
    p.add_argument("--seed", type=int, help="split seed (default: the first run's, else 0)")
    p.add_argument(
        "--projection", choices=("tsne", "pca"), default="tsne", help="2-D map (default: tsne)"
    )
    p.add_argument(
        "--max-items",
        dest="max_items",
        type=int,
        default=3000,
        help="embed at most this many held-out images, a seeded subset (default: 3000)",
    )
    p.add_argument("--batch-size", dest="batch_size", type=int, default=256)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.set_defaults(handler=run_analyze)
