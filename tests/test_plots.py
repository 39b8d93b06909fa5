"""The figures read right: whole epochs on the training curves, and similarity panels
that share their x range so that models compare by eye."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vitrieval.training.analyze import Embedded, ModelRef, pair_cosines, plot_similarity
from vitrieval.training.plots import plot_curves

PNG = b"\x89PNG\r\n\x1a\n"


def visible_ticks(ax) -> np.ndarray:
    low, high = sorted(ax.get_xlim())
    ticks = np.asarray(ax.get_xticks())
    return ticks[(ticks >= low) & (ticks <= high)]


def test_curves_tick_whole_epochs(tmp_path):
    # 3 epochs: matplotlib's default locator would tick at 1.00, 1.25, 1.50 ...
    history = [
        {"epoch": e, "loss": 3.0 / e, "recall@1": 0.3 * e, "map": 0.2 * e, "map_at_r": None}
        for e in (1, 2, 3)
    ]
    fig = plot_curves(history, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    assert len(fig.axes) == 2
    for ax in fig.axes:
        ticks = visible_ticks(ax)
        assert len(ticks) >= 2
        np.testing.assert_array_equal(ticks, np.round(ticks))
        assert {1.0, 2.0, 3.0} <= set(ticks.tolist())


def embedded(name: str, embeddings: np.ndarray, labels: list[str]) -> Embedded:
    return Embedded(ModelRef(name, Path(f"{name}.onnx"), "onnx"), embeddings, labels)


def test_similarity_panels_share_one_x_range(tmp_path):
    rng = np.random.default_rng(0)
    labels = [str(i % 3) for i in range(30)]
    # an "untrained" encoder: every vector close to one direction, cosines 0.99..1
    narrow = np.ones((30, 16)) + 0.01 * rng.standard_normal((30, 16))
    # a spread one: cosines down to about -0.6
    wide = rng.standard_normal((30, 16))
    models = []
    for name, x in (("initial", narrow), ("trained", wide)):
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        models.append(embedded(name, x, labels))
    summaries = [{"name": m.ref.name, "isotropy": 0.5} for m in models]
    fig = plot_similarity(models, summaries, tmp_path / "similarity.png")
    assert (tmp_path / "similarity.png").read_bytes()[:8] == PNG
    first, second = fig.axes[0], fig.axes[1]
    assert first.get_xlim() == second.get_xlim()
    assert first.get_shared_x_axes().joined(first, second)
    # the range holds every model's cosines, the narrow one's included
    low, high = first.get_xlim()
    for m in models:
        pos, neg = pair_cosines(m.embeddings, m.labels)
        both = np.concatenate([pos, neg])
        assert low < both.min() and both.max() < high
    narrow_pos, narrow_neg = pair_cosines(models[0].embeddings, labels)
    assert min(narrow_pos.min(), narrow_neg.min()) > 0.99
    assert low < 0  # the spread model sets it, not the narrow one
    # and both panels use the same bins
    widths = [{round(p.get_width(), 12) for p in ax.patches} for ax in (first, second)]
    assert widths[0] == widths[1] and len(widths[0]) == 1
