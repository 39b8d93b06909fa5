"""`vitrieval-train pretrain`: self-supervised pretraining on a folder of unlabelled images.

DenseCL++ (docs/papers.md) and its two baselines, on two augmented views of every image
(random resized crop, flip, colour jitter, grayscale, Gaussian blur; SimCLR's set):

    densecl++   (1 - lambda) L_g + lambda L_d, L_d with dense negatives: one random token
                per other-image view (Fig. 2a, eq. 2), or `--negatives guided` (eq. 3
                and the N least similar tokens of the positive view); lambda 0.9
    densecl     the same with DenseCL's negatives, the other images' global vectors
                (eq. 1); lambda 0.3, the paper's best for it
    simclr      L_g alone (lambda 0; no dense head)

plus gamma L_r (eq. 5) with `--recon-weight gamma` > 0: an L1 reconstruction of the
normalised input view from the dense projections (appendix B, eq. 4). L_g is
InfoNCELoss on the global head's output, L_d DenseContrastiveLoss on the dense
head's (training/losses/), both at one temperature `--temperature` (default:
InfoNCEOptions.temperature in training/options.py, SimCLR's; the paper does not state
its tau). Heads: training/selfsup_heads.py.

The run folder works with the rest of the tool chain: `config.yaml` is the FitConfig
of the embedding model (backbone, pooling `--global-pool`, avg by default: the mean
of the patch tokens, L2-normalised, which is what the paper's GAP rows evaluate) so
that `export --run`, `analyze` and `fit --init` read it as any run; `pretrain.yaml`
is the merged pretraining configuration that `--resume` reads. `model.safetensors` is
the embedding model only; the heads live in the checkpoint's `loss` part.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

from vitrieval.index.atomic import atomic_path
from vitrieval.index.evaluation.datasets import DatasetError, Item
from vitrieval.index.pipeline.sources import walk_images

from .amp import MixedPrecision
from .augment import TwoViews, contrastive_view_transform
from .data import ImageDataset, drop_unreadable
from .decode_cache import DecodeCache
from .device import describe_device, pick_device
from .epochs import Stage, seed_everything, shuffled_batches, steps_per_epoch, train_run
from .losses import DenseContrastiveLoss, InfoNCELoss
from .model import EmbeddingModel, build_model
from .optim import param_groups
from .pretrain_config import PretrainConfig
from .progress import EpochClock
from .run_folder import (
    CURVES_FILE,
    TrainingError,
    claim_run_folder,
    save_config,
    show_metric,
    start_or_resume,
    write_skipped,
)
from .selfsup_heads import PretrainHeads


def view_transform(data_config: dict, crop_scale: float, hflip: float) -> v2.Compose:
    """PIL image -> one augmented view, float32 (3, H, W) normalised.

    SimCLR's operations as the paper lists them (crop, flip, colour jitter, blur; plus
    SimCLR's grayscale): training/augment.py's views at its strengths, without rotation.
    """
    return contrastive_view_transform(data_config, crop_scale, hflip, rotation=False)


class Objective(nn.Module):
    """(1 - lambda) L_g + lambda L_d + gamma L_r (eq. 5) of one batch of 2B views."""

    def __init__(self, cfg: PretrainConfig):
        super().__init__()
        self.dense_weight = float(cfg.dense_weight)
        self.recon_weight = float(cfg.recon_weight)
        self.global_loss = InfoNCELoss(cfg.temperature)
        self.dense_loss = None
        if cfg.method != "simclr":
            self.dense_loss = DenseContrastiveLoss(
                cfg.negatives,
                cfg.temperature,
                candidates=cfg.candidates,
                beta=cfg.beta,
                cross_view_negatives=cfg.cross_view_negatives,
            )

    def forward(
        self, out: Any, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, dict[str, float | None]]:
        """out: PretrainOutputs of `images` (2B, 3, H, W) -> (total loss, its parts)."""
        global_loss = self.global_loss(out.global_z)
        total = (1.0 - self.dense_weight) * global_loss
        parts: dict[str, float | None] = {"global_loss": global_loss.item()}
        parts["dense_loss"] = parts["recon_loss"] = None
        if self.dense_loss is not None:
            dense = self.dense_loss(out.dense_z, out.features, generator)
            total = total + self.dense_weight * dense
            parts["dense_loss"] = dense.item()
        if out.recon is not None:
            recon = F.l1_loss(out.recon.float(), images.float())  # eq. 4: mean absolute error
            total = total + self.recon_weight * recon
            parts["recon_loss"] = recon.item()
        return total, parts


def build_pretrain_model(cfg: PretrainConfig, load_pretrained: bool = True):
    """(encoder EmbeddingModel, PretrainHeads); fills cfg.head_hidden_dim if unset."""
    encoder = build_model(
        cfg.backbone,
        cfg.global_pool,
        pretrained=cfg.pretrained if load_pretrained else None,
        drop_path_rate=cfg.drop_path,
    )
    width = int(encoder.backbone.num_features)
    if cfg.head_hidden_dim is None:
        cfg.head_hidden_dim = 4 * width
    grid = image_size = None
    if cfg.recon_weight > 0:
        grid = tuple(encoder.backbone.patch_embed.grid_size)
        image_size = tuple(encoder.data_config()["input_size"][1:])
    heads = PretrainHeads(
        width, cfg.head_hidden_dim, cfg.proj_dim, cfg.method != "simclr", grid, image_size
    )
    return encoder, heads


def list_images(folder: str) -> list[Item]:
    """Every image file below `folder` (index.pipeline.sources' rule: image suffix, not hidden)."""
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"--images folder not found: {root}")
    items = walk_images(root)
    if not items:
        raise DatasetError(f"{root}: no images found (searched recursively)")
    return items


def readable_images(items: list[Item], run: Path, cache: DecodeCache | None = None) -> list[Item]:
    """The items that decode (opening `cache`'s copies when given); the others are
    listed in RUN/skipped.txt."""
    items, skipped = drop_unreadable(items, "images", cache)
    if cache is not None and (cache.stats.decoded or cache.stats.reused):
        print(cache.summary())
    write_skipped(run, skipped)
    if len(items) < 2:
        raise TrainingError("contrastive pretraining needs at least 2 readable images")
    return items


def _optimizer(encoder: EmbeddingModel, heads: nn.Module, cfg: PretrainConfig):
    """The project's AdamW groups (no decay on biases, norms, tokens), heads included."""
    groups = param_groups(encoder, nn.Module(), cfg.weight_decay, 1.0, 1.0)
    for decay in (True, False):
        params = [p for p in heads.parameters() if (p.ndim >= 2) == decay]
        if params:
            wd = cfg.weight_decay if decay else 0.0
            groups.append({"params": params, "weight_decay": wd, "lr_scale": 1.0})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999))


def pretrain(cfg: PretrainConfig, resume: bool = False) -> dict:
    """Pretrain per `cfg` into the run folder `cfg.out`; returns the last epoch's row.
    Ctrl-C or SIGTERM stops it cleanly (training/epochs.py's `train_run`)."""
    return train_run(cfg, "pretrain", lambda cfg: _pretrain(cfg, resume))


def _pretrain(cfg: PretrainConfig, resume: bool) -> dict:
    run = Path(cfg.out)
    claim_run_folder(run, resume, "pretrain", "pretrain")
    items = list_images(cfg.images)
    device = pick_device(cfg.device)
    seed_everything(cfg.seed)
    encoder, heads = build_pretrain_model(cfg, load_pretrained=not resume)
    encoder, heads = encoder.to(device), heads.to(device)
    run.mkdir(parents=True, exist_ok=True)
    cache = DecodeCache.for_run(
        cfg.decode_cache, cfg.decode_cache_dir, run, encoder.data_config(), cfg.crop_scale
    )
    items = readable_images(items, run, cache)
    objective = Objective(cfg)
    optimizer = _optimizer(encoder, heads, cfg)

    saved_state, start_epoch, history = start_or_resume(run, encoder, heads, optimizer, resume)
    save_config(run, cfg)

    views = TwoViews(view_transform(encoder.data_config(), cfg.crop_scale, cfg.hflip))
    dataset = ImageDataset(items, {None: 0}, views)  # unlabelled: every label is None
    amp = MixedPrecision(cfg.amp, device)
    amp.restore(saved_state)
    steps = steps_per_epoch(len(dataset), cfg.batch_size)
    stage = Stage.of(cfg, "epoch", steps, optimizer, [encoder, heads], amp)
    negatives = f", negatives {cfg.negatives}" if cfg.negatives else ""
    print(
        f"pretraining {cfg.backbone}+{cfg.global_pool} with {cfg.method} (lambda "
        f"{cfg.dense_weight}{negatives}, tau {cfg.temperature}) on {len(items)} images "
        f"on {describe_device(device, amp.active_dtype)}"
    )

    def step(batch: tuple, generator: torch.Generator) -> tuple[torch.Tensor, int, dict]:
        (first, second), _ = batch
        # rows i and B + i are the two views of image i
        images = torch.cat([first, second]).to(device, non_blocking=True)
        with amp.autocast():
            out = heads(encoder, images)
        loss, parts = objective(out, images, generator)
        size = len(first)
        return loss, size, {k: None if v is None else v * size for k, v in parts.items()}

    started = time.perf_counter()
    clock = EpochClock(start_epoch, cfg.epochs)
    row: dict = history[-1] if history else {}
    for epoch, seed in stage.epochs_after(start_epoch):
        # the epoch's seed also draws the dense negatives: a resumed run draws the same
        generator = torch.Generator(device=device).manual_seed(seed)
        loader = shuffled_batches(
            dataset, cfg.batch_size, seed, cfg.workers, pin_memory=device.type == "cuda"
        )
        done = stage.train_epoch(epoch, loader, partial(step, generator=generator))
        row = {"epoch": epoch}
        for key in ("loss", "global_loss", "dense_loss", "recon_loss"):
            row[key] = done.mean(key)
        row.update(lr=done.lr, **done.timings())
        stage.commit(run, encoder, heads, cfg, row, history, stage="pretrain", method=cfg.method)
        plot_losses(history, run / CURVES_FILE)
        print(
            f"epoch {epoch}/{cfg.epochs}  loss {row['loss']:.4f}  "
            f"L_g {row['global_loss']:.4f}  L_d {show_metric(row['dense_loss'])}  "
            f"L_r {show_metric(row['recon_loss'])}  lr {done.lr:.2e}  {done.seconds:.1f}s "
            f"({row['train_images_per_s']:.0f} img/s)  {clock.text(epoch)}"
        )
    elapsed = time.perf_counter() - started
    if row:
        print(
            f"done: {cfg.method}, {cfg.epochs} epochs, loss {row['loss']:.4f} in "
            f"{elapsed:.0f}s -> {run} (embedding: {cfg.backbone}+{cfg.global_pool})"
        )
    return row


def plot_losses(history: list[dict], path: Path) -> None:
    """curves.png: the total loss and its parts per epoch."""
    from .plots import plt  # matplotlib with the Agg backend

    fig, ax = plt.subplots(figsize=(5, 3.4), constrained_layout=True)
    epochs = [row["epoch"] for row in history]
    for key, label in (
        ("loss", "total"),
        ("global_loss", "L_g"),
        ("dense_loss", "L_d"),
        ("recon_loss", "L_r"),
    ):
        values = [row.get(key) for row in history]
        if any(v is not None for v in values):
            ys = [float("nan") if v is None else v for v in values]
            ax.plot(epochs, ys, marker="o", ms=3, label=label)
    ax.set(title="pretraining loss", xlabel="epoch", ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
