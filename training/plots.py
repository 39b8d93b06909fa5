"""Training curves as a PNG: loss and held-out R@1 / mAP per epoch."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers; must precede pyplot
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vitrieval.index.atomic import atomic_path


def plot_curves(history: list[dict], path: Path) -> Figure:
    """history: the rows of metrics.jsonl; writes a two-panel figure to `path`.

    Returns the (closed) figure. Epochs are whole numbers: the epoch axes tick at
    integers only (a short run would otherwise get ticks at 1.25, 1.5 ...).
    """
    epochs = [row["epoch"] for row in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    # an epoch-0 row (`fit --epochs 0`: the initial model) has no loss
    loss = [float("nan") if row.get("loss") is None else row["loss"] for row in history]
    left.plot(epochs, loss, marker="o", ms=3)
    left.set(title="training loss", xlabel="epoch", ylabel="loss")
    measured = False
    for key, label in (("recall@1", "R@1"), ("map", "mAP"), ("map_at_r", "MAP@R")):
        values = [row.get(key) for row in history]
        if any(v is not None for v in values):
            measured = True
            right.plot(
                epochs,
                [float("nan") if v is None else v for v in values],
                marker="o",
                ms=3,
                label=label,
            )
    right.set(title="held-out retrieval (leave-one-out)", xlabel="epoch", ylim=(0, 1.01))
    if measured:
        right.legend(loc="lower right")
    else:  # --test-fraction 0: nothing held out
        right.text(0.5, 0.5, "no held-out evaluation", ha="center", transform=right.transAxes)
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return fig
