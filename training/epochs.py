"""The epoch loop of every training method: `fit` (training/trainer.py), `fit --method
lacvit | ce` and its linear probe (training/lacvit.py), and `pretrain`
(training/pretrain.py).

Every epoch reseeds Python, NumPy and torch from (seed, epoch), so a resumed run draws
the batches, augmentations and negatives an unbroken run would; puts the modules it
trains in train mode; and for every batch sets the step's learning rate (linear
warm-up, then cosine to a floor: training/optim.py) on every parameter group, runs the
method's step (forward pass and loss), stops on a non-finite loss, backpropagates,
clips and steps under mixed precision (training/amp.py), and sums the loss and the
step's other totals over the epoch, with a progress bar on a terminal. The method turns
the sums into its metrics row; `Stage.commit` writes the checkpoint and the row as one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from .amp import MixedPrecision
from .interrupt import deferred, loader_batches, stoppable
from .optim import lr_at
from .run_folder import TrainingError, append_metrics, save_checkpoint
from .threads import apply_threads, usable_cores

logger = logging.getLogger("vitrieval.train")

Step = Callable[[Any], tuple[torch.Tensor, int, dict[str, float | None]]]
"""A batch -> (its loss, the number of items it counts for, totals of other values over
the batch: summed over the epoch, None where the batch has none)."""


def train_run(cfg: Any, command: str, train: Callable[[Any], dict]) -> dict:
    """`train(cfg)` with `cfg` resolved and validated. Ctrl-C or SIGTERM stops it with the
    data-loader workers shut down and one line naming the checkpoint that `--resume`
    continues from (training/interrupt.py)."""
    given_threads = cfg.threads
    cfg = cfg.resolved()
    cfg.validate()
    # before the model and the data exist: torch's thread pools start with the first op
    apply_threads(cfg.threads)
    logger.info(
        "torch threads: %d (--threads %s, %d data-loading workers, %d cores)",
        cfg.threads,
        given_threads,
        cfg.workers,
        usable_cores(),
    )
    with stoppable(Path(cfg.out), command):
        return train(cfg)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch of a run seeded with `seed`."""
    return seed * 100_003 + epoch


def steps_per_epoch(items: int, batch_size: int) -> int:
    """Batches per epoch of `shuffled_batches`: full batches only, or one when every
    item fits in one."""
    return items // batch_size if items > batch_size else 1


def shuffled_batches(
    dataset: Dataset, batch_size: int, seed: int, workers: int, pin_memory: bool = False
) -> DataLoader:
    """An epoch's batches in an order drawn from `seed`, the last partial batch dropped
    (unless it is the only one)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=len(dataset) > batch_size,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=pin_memory,
    )


@dataclass
class EpochSums:
    """What an epoch of training summed: the loss and the steps' totals over `seen` items."""

    epoch: int
    lr: float
    sums: dict[str, float]
    seen: int
    seconds: float

    def mean(self, key: str) -> float | None:
        """The mean per item of a summed value (None when no step gave one)."""
        return self.sums[key] / max(self.seen, 1) if key in self.sums else None

    def timings(self) -> dict[str, float]:
        """The metrics row's `train_seconds` and `train_images_per_s`."""
        return {
            "train_seconds": round(self.seconds, 3),
            "train_images_per_s": round(self.seen / self.seconds, 1),
        }


@dataclass
class Stage:
    """The optimisation of one training stage: what every epoch of it repeats."""

    name: str  # the progress bar's label: "epoch", "contrastive", "probe"
    epochs: int
    steps_per_epoch: int
    peak_lr: float
    warmup_epochs: float
    min_lr_ratio: float
    optimizer: torch.optim.Optimizer
    modules: Sequence[nn.Module]  # put in train mode every epoch; their gradients clipped
    amp: MixedPrecision
    seed: int
    clip_grad: float | None = None
    seed_offset: int = 0  # a second stage of a run draws from seeds of its own
    lr_flag: str = "--lr"  # the option that a diverging loss asks to lower
    progress: bool = True

    @classmethod
    def of(
        cls,
        cfg: Any,
        name: str,
        steps: int,
        optimizer: torch.optim.Optimizer,
        modules: Sequence[nn.Module],
        amp: MixedPrecision,
    ) -> Stage:
        """A stage trained by `cfg` (a FitConfig or PretrainConfig): its epochs, peak
        learning rate, warm-up, floor, gradient clipping and seed."""
        return cls(
            name,
            cfg.epochs,
            steps,
            cfg.lr,
            cfg.warmup_epochs,
            cfg.min_lr_ratio,
            optimizer,
            modules,
            amp,
            cfg.seed,
            cfg.clip_grad,
        )

    def epochs_after(self, done: int) -> Iterator[tuple[int, int]]:
        """(epoch, its seed) of every epoch after `done`, each with Python, NumPy and torch
        reseeded from that seed."""
        for epoch in range(done + 1, self.epochs + 1):
            seed = epoch_seed(self.seed, epoch) + self.seed_offset
            seed_everything(seed)
            yield epoch, seed

    def lr(self, epoch: int, step_in_epoch: int) -> float:
        """The learning rate of a step: linear warm-up, then cosine to the floor."""
        return lr_at(
            (epoch - 1) * self.steps_per_epoch + step_in_epoch,
            self.epochs * self.steps_per_epoch,
            round(self.warmup_epochs * self.steps_per_epoch),
            self.peak_lr,
            self.min_lr_ratio,
        )

    def train_epoch(self, epoch: int, loader: DataLoader, step: Step) -> EpochSums:
        """One pass over `loader`, a `step` and an optimiser step per batch."""
        for module in self.modules:
            module.train()
        params = [p for module in self.modules for p in module.parameters()]
        started = time.perf_counter()
        sums: dict[str, float] = {}
        seen, lr = 0, self.peak_lr
        bar = tqdm(
            total=self.steps_per_epoch,
            unit="step",
            desc=f"{self.name} {epoch}/{self.epochs}",
            leave=False,
            disable=None if self.progress else True,
        )
        with loader_batches(loader) as batches:
            for step_in_epoch, batch in enumerate(batches):
                lr = self.lr(epoch, step_in_epoch)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)
                loss, items, totals = step(batch)
                if not torch.isfinite(loss):
                    raise TrainingError(
                        f"loss became {loss.item()} at epoch {epoch}; lower {self.lr_flag}"
                    )
                self.amp.optimizer_step(loss, self.optimizer, params, self.clip_grad)
                sums["loss"] = sums.get("loss", 0.0) + loss.item() * items
                for key, total in totals.items():
                    if total is not None:
                        sums[key] = sums.get(key, 0.0) + total
                seen += items
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{lr:.2e}")
        bar.close()
        return EpochSums(epoch, lr, sums, seen, time.perf_counter() - started)

    def commit(
        self,
        run: Path,
        model: nn.Module,
        head: nn.Module,
        cfg: Any,
        row: dict,
        history: list[dict],
        **state: Any,
    ) -> None:
        """The checkpoint of the epoch of `row` (model, head as its `loss` part, the
        optimiser; `state` adds to state.json) and `row`, written as one: a signal waits
        until both are (training/interrupt.py). Then `row` joins `history`."""
        state = {
            "epoch": row["epoch"],
            **state,
            "config": asdict(cfg),
            "grad_scaler": self.amp.state(),
        }
        with deferred():
            save_checkpoint(run, model, head, self.optimizer, state)
            append_metrics(run, row)
        history.append(row)
