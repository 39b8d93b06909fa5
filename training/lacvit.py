"""LaCViT's two-stage training and its cross-entropy baseline (`fit --method lacvit | ce`).

LaCViT (docs/papers.md; the paper's "Label-aware contrastive training" and "Task head
fine-tuning"):

Stage 1, `contrastive` (`--epochs`): each image of a batch of B is augmented twice
(training/augment.py); the 2B views go through the encoder f, the EmbeddingModel
(backbone, pooling, optional `--dim` projection, L2 norm: exactly what is exported), to
h = f(x), (2B, D); then through the projection head of the paper's "Nonlinear
projection head" paragraph, z = g(h) = W2 relu(W1 h), (2B, 128), L2-normalised; and
into SupConLoss at tau `--temperature` (default: SupConOptions.temperature, LaCViT's),
the paper's "Contrastive Training Objective" equation (training/losses/supcon.py), over
the 2B flattened views with the labels repeated, so an image's other view is one of its
positives. The head g is then dropped:
RUN/model.safetensors holds the encoder only.

Stage 2, `probe` (`--probe-epochs`): the encoder is frozen (eval mode, no gradients)
and a linear classifier (`LinearClassifier`: W BN(h) + b, BN a fixed standardisation
at inference) on the embedding of one lightly augmented view per image is trained
with cross-entropy, by SGD with momentum 0.9 and the paper's weight decay 1e-4, at
`--probe-lr` on a cosine schedule. Saved as RUN/classifier.safetensors.

Baseline `ce`, stage `finetune` (`--epochs`): encoder + linear classifier trained end
to end with cross-entropy on the same data stream as stage 1 (the same two views of
every image, optimiser, schedule and epochs): the methods differ only in objective and
head, and LaCViT spends the extra probe epochs (forward passes only).

Stage 1 and the baseline use the project's optimiser recipe (AdamW, warm-up + cosine,
layer decay, clipping; training/optim.py) rather than the paper's learning rate 0.01,
which is for fine-tuning pretrained weights with batches of 4096. Retrieval metrics
and the isotropy score are always of the encoder embedding h (never of z), on the
held-out split, after every epoch; the `initial` row (epoch 0) scores the encoder
before training, whose weights are kept as RUN/initial.safetensors for analysis.
Stage 1 checkpoints every epoch like `fit` (the head in the checkpoint's `loss`
part), so `--resume` continues it; the probe is cheap and is always trained afresh.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitrieval.index.atomic import atomic_write_text
from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.evaluation.metrics import isotropy_score, retrieval_metrics

from .amp import MixedPrecision
from .augment import TwoViews, contrastive_view_transform, light_transform
from .checkpoint import save_tensors
from .config import FitConfig
from .data import ImageDataset, build_transforms, epoch_loader
from .device import describe_device
from .epochs import Stage, seed_everything, shuffled_batches, steps_per_epoch
from .evaluate import EVAL_KS, embed_items
from .losses import SupConLoss
from .model import EmbeddingModel
from .optim import param_groups
from .plots import plot_curves
from .progress import EpochClock
from .run_folder import (
    CLASSIFIER_FILE,
    CURVES_FILE,
    INITIAL_FILE,
    RESULTS_FILE,
    append_metrics,
    claim_run_folder,
    json_metric,
    save_config,
    show_metric,
    start_or_resume,
)

PROBE_MOMENTUM = 0.9
PROBE_WEIGHT_DECAY = 1e-4  # the paper's, for both stages; here for the probe's SGD
FIRST_STAGE = {"lacvit": "contrastive", "ce": "finetune"}


class ProjectionHead(nn.Module):
    """z = g(h) = W2 relu(W1 h), L2-normalised: (N, D) -> (N, out_dim), unit norm.

    The paper's two dense layers with a ReLU between them; the hidden width is D.
    Used in stage 1 only: the contrastive loss sees z, retrieval and the probe see h.
    """

    def __init__(self, in_dim: int, out_dim: int = 128, hidden_dim: int | None = None):
        super().__init__()
        hidden = hidden_dim or in_dim
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out_dim)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(h.float()), dim=-1)


class LinearClassifier(nn.Module):
    """Logits (N, C) = W BN(h) + b for embeddings h (N, D): a linear classifier.

    BN is a BatchNorm without affine parameters, as in MAE's linear probing: it
    standardises every embedding dimension, so the classifier trains at one learning
    rate whatever the spread of the embeddings (a barely trained encoder maps every
    image to nearly the same unit vector, and a plain linear layer on that learns
    slowly). In eval mode BN is a fixed per-dimension affine map, so the whole module
    is one linear map of h. Both methods use it: the LaCViT probe and the CE head.

    The running statistics start from the first training batch's rather than
    BatchNorm's (mean 0, variance 1): embeddings whose dimensions vary by 1e-2 would
    otherwise be scaled by the leftover unit variance for tens of steps (0.9^k of it
    remains after k steps at momentum 0.1), and evaluation would see squashed inputs.
    """

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(dim, affine=False)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        if self.training and int(self.norm.num_batches_tracked) == 0:
            momentum, self.norm.momentum = self.norm.momentum, 1.0
            try:
                normed = self.norm(h)
            finally:
                self.norm.momentum = momentum
            return self.fc(normed)
        return self.fc(self.norm(h))


@dataclass
class Data:
    """The readable items of a run's split, its classes and the model's eval transform."""

    train: list[Item]
    test: list[Item]
    classes: list[str]
    eval_transform: Callable
    data_config: dict

    @property
    def class_to_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}


def encoder_scores(embeddings: np.ndarray, labels: Sequence[str]) -> dict:
    """Leave-one-out retrieval metrics and the isotropy score of embeddings (N, D)."""
    scores = {
        k: json_metric(v) for k, v in retrieval_metrics(embeddings, labels, ks=EVAL_KS).items()
    }
    scores["isotropy"] = isotropy_score(embeddings)
    return scores


@torch.no_grad()
def top1_accuracy(
    classifier: nn.Module,
    embeddings: np.ndarray,
    labels: Sequence[str],
    class_to_index: dict[str, int],
) -> float | None:
    """Share of items whose argmax class is their label; items of classes the
    classifier never saw (class-disjoint splits) are left out; None if none is left."""
    keep = [i for i, label in enumerate(labels) if label in class_to_index]
    if not keep:
        return None
    was_training = classifier.training
    classifier.eval()
    weight = next(classifier.parameters())
    logits = classifier(torch.from_numpy(embeddings[keep]).to(weight.device, weight.dtype))
    classifier.train(was_training)
    target = torch.tensor([class_to_index[labels[i]] for i in keep], device=logits.device)
    return float((logits.argmax(dim=1) == target).float().mean())


def train_probe(
    model: EmbeddingModel,
    data: Data,
    cfg: FitConfig,
    device: torch.device,
    on_epoch: Callable[[dict], None] | None = None,
) -> tuple[LinearClassifier, dict]:
    """Stage 2: a linear classifier (C, D) on the frozen encoder's embeddings.

    The encoder is put in eval mode and gets no gradients (its weights are untouched);
    one lightly augmented view per training image per epoch; SGD with momentum, cosine
    schedule from `cfg.probe_lr`. Returns the classifier and the last epoch's row
    (`stage` "probe", held-out `top1`, and the encoder's retrieval scores).
    """
    model.eval().requires_grad_(False)
    class_to_index = data.class_to_index
    test_labels = [item.label for item in data.test]
    test_emb = embed_items(model, data.test, data.eval_transform, cfg.eval_batch_size, device)
    encoder = encoder_scores(test_emb, test_labels)  # frozen: fixed for the whole stage

    seed_everything(cfg.seed * 100_003 + 77_777)
    probe = LinearClassifier(model.embedding_dim, len(data.classes)).to(device)
    optimizer = torch.optim.SGD(
        probe.parameters(),
        lr=cfg.probe_lr,
        momentum=PROBE_MOMENTUM,
        weight_decay=PROBE_WEIGHT_DECAY,
    )
    transform = light_transform(data.data_config, cfg.crop_scale, cfg.hflip)
    dataset = ImageDataset(data.train, class_to_index, transform)
    amp = MixedPrecision(cfg.amp, device)  # the encoder's forward pass
    stage = Stage(
        name="probe",
        epochs=cfg.probe_epochs,
        steps_per_epoch=steps_per_epoch(len(dataset), cfg.batch_size),
        peak_lr=cfg.probe_lr,
        warmup_epochs=0.0,  # cosine from the first step down to 0
        min_lr_ratio=0.0,
        optimizer=optimizer,
        modules=[probe],
        amp=MixedPrecision(False, device),  # the probe's own step: float32, unclipped
        seed=cfg.seed,
        seed_offset=50_000,
        lr_flag="--probe-lr",
        progress=False,
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int, dict]:
        images, labels = batch
        labels = labels.to(device)
        with torch.no_grad(), amp.autocast():
            h = model(images.to(device))
        logits = probe(h)
        loss = F.cross_entropy(logits, labels)
        return loss, len(labels), {"correct": int((logits.argmax(dim=1) == labels).sum())}

    row: dict = {}
    for epoch, seed in stage.epochs_after(0):
        loader = shuffled_batches(dataset, cfg.batch_size, seed, cfg.workers or 0)
        done = stage.train_epoch(epoch, loader, step)
        row = {
            "stage": "probe",
            "epoch": epoch,
            "loss": done.mean("loss"),
            "lr": done.lr,
            "train_top1": done.mean("correct"),
            "top1": top1_accuracy(probe, test_emb, test_labels, class_to_index),
            **encoder,
            **done.timings(),
        }
        if on_epoch:
            on_epoch(row)
    return probe.eval(), row


def _prepare(cfg: FitConfig, prepared: tuple) -> tuple[Path, torch.device, EmbeddingModel, Data]:
    """Run folder, device, seeded model (with --init weights), and the readable split,
    from what training/trainer.py's `prepare_run` prepared."""
    run, device, model, split, train, test = prepared
    data_config = model.data_config()
    _, eval_tf = build_transforms(data_config, cfg.crop_scale, cfg.hflip, None)
    classes = sorted({item.label for item in train})
    amp = MixedPrecision(cfg.amp, device)
    print(
        f"{cfg.method}: {cfg.backbone}+{cfg.pool} on {split.name} ({len(train)} train / "
        f"{len(test)} held-out images, {len(classes)} classes) on "
        f"{describe_device(device, amp.active_dtype)}"
    )
    return run, device, model, Data(train, test, classes, eval_tf, data_config)


def _optimizer(model: EmbeddingModel, head: nn.Module, cfg: FitConfig) -> torch.optim.AdamW:
    """The project's AdamW groups for the encoder, plus the head (no decay on biases)."""
    groups = param_groups(model, nn.Module(), cfg.weight_decay, cfg.layer_decay, 1.0)
    for decay in (True, False):
        params = [p for p in head.parameters() if (p.ndim >= 2) == decay]
        groups.append(
            {
                "params": params,
                "weight_decay": cfg.weight_decay if decay else 0.0,
                "lr_scale": 1.0,
                "name": "head" if decay else "head_no_decay",
            }
        )
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999))


def fit_method(cfg: FitConfig, prepared: tuple, resume: bool = False) -> dict:
    """`fit --method lacvit | ce` into `cfg.out` (a resolved, validated config), from
    what training/trainer.py's `prepare_run` prepared.

    Returns the run's results (also written to RUN/results.json): held-out `top1` of
    the classifier, the encoder's retrieval metrics and isotropy after training, and
    `initial_*` scores of the encoder before it.
    """
    stage_name = FIRST_STAGE[cfg.method]
    run, device, model, data = _prepare(cfg, prepared)
    class_to_index = data.class_to_index
    test_labels = [item.label for item in data.test]
    if cfg.method == "lacvit":
        head: nn.Module = ProjectionHead(model.embedding_dim, cfg.proj_dim)
        supcon = SupConLoss(temperature=cfg.temperature)

        def objective(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int | None]:
            return supcon(head(h), labels), None
    else:
        head = LinearClassifier(model.embedding_dim, len(data.classes))

        def objective(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int | None]:
            logits = head(h)
            return F.cross_entropy(logits, labels), int((logits.argmax(1) == labels).sum())

    head = head.to(device)
    optimizer = _optimizer(model, head, cfg)

    if resume:
        claim_run_folder(run, resume, stage_name, cfg.method)

    def keep(row: dict, epoch: int) -> bool:
        # the encoder's initial scores, and stage 1 up to the checkpoint (never the probe)
        return row.get("stage") == "initial" or (
            row.get("stage") == stage_name and row["epoch"] <= epoch
        )

    state, start_epoch, history = start_or_resume(
        run, model, head, optimizer, resume, keep, f"{stage_name} epoch"
    )
    save_config(run, cfg)

    def record(row: dict) -> None:
        append_metrics(run, row)
        history.append(row)

    started = time.perf_counter()
    if not any(r.get("stage") == "initial" for r in history):
        save_tensors(run / INITIAL_FILE, model.state_dict())
        emb = embed_items(model, data.test, data.eval_transform, cfg.eval_batch_size, device)
        record({"stage": "initial", "epoch": 0, **encoder_scores(emb, test_labels)})
        print(
            f"initial encoder: R@1 {show_metric(history[-1]['recall@1'])}  "
            f"isotropy {history[-1]['isotropy']:.4f}"
        )

    views = TwoViews(contrastive_view_transform(data.data_config, cfg.crop_scale, cfg.hflip))
    dataset = ImageDataset(data.train, class_to_index, views)
    amp = MixedPrecision(cfg.amp, device)
    amp.restore(state)
    steps = len(epoch_loader(dataset, cfg, 1))
    stage = Stage.of(cfg, stage_name, steps, optimizer, [model, head], amp)

    def step(batch: tuple) -> tuple[torch.Tensor, int, dict]:
        (first, second), labels = batch
        # the 2B views flattened into one batch: rows i and B + i are one image
        images = torch.cat([first, second]).to(device, non_blocking=True)
        labels = labels.to(device).repeat(2)
        with amp.autocast():
            loss, n_correct = objective(model(images), labels)
        return loss, len(labels), {"correct": n_correct}

    clock = EpochClock(start_epoch, cfg.epochs)
    for epoch, _ in stage.epochs_after(start_epoch):  # a resumed run draws the same views
        loader = epoch_loader(dataset, cfg, epoch, pin_memory=device.type == "cuda")
        done = stage.train_epoch(epoch, loader, step)
        emb = embed_items(model, data.test, data.eval_transform, cfg.eval_batch_size, device)
        row = {"stage": stage_name, "epoch": epoch, "loss": done.mean("loss"), "lr": done.lr}
        if cfg.method == "ce":
            row["train_top1"] = done.mean("correct")
            row["top1"] = top1_accuracy(head, emb, test_labels, class_to_index)
        row.update(encoder_scores(emb, test_labels))
        row.update(done.timings())
        stage.commit(run, model, head, cfg, row, history, stage=stage_name)
        plot_curves([r for r in history if r["stage"] == stage_name], run / CURVES_FILE)
        top1 = f"top-1 {show_metric(row['top1'])}  " if "top1" in row else ""
        print(
            f"{stage_name} {epoch}/{cfg.epochs}  loss {row['loss']:.4f}  {top1}"
            f"R@1 {show_metric(row['recall@1'])}  mAP {show_metric(row['map'])}  "
            f"isotropy {row['isotropy']:.4f}  {done.seconds:.1f}s "
            f"({row['train_images_per_s']:.0f} views/s)  {clock.text(epoch)}"
        )

    classifier_stage = stage_name
    if cfg.method == "lacvit":
        classifier_stage = "probe"

        def report(row: dict) -> None:
            record(row)
            print(
                f"probe {row['epoch']}/{cfg.probe_epochs}  loss {row['loss']:.4f}  "
                f"top-1 {show_metric(row['top1'])}  {row['train_seconds']:.1f}s"
            )

        head, _ = train_probe(model, data, cfg, device, on_epoch=report)
    save_tensors(
        run / CLASSIFIER_FILE,
        head.state_dict(),
        {"classes": json.dumps(data.classes), "input": "embedding", "stage": classifier_stage},
    )
    results = _results(cfg, history, classifier_stage, time.perf_counter() - started)
    atomic_write_text(run / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    print(
        f"done: {cfg.method}, held-out top-1 {show_metric(results['top1'])}, encoder R@1 "
        f"{show_metric(results['recall@1'])} mAP {show_metric(results['map'])}, isotropy "
        f"{results['initial_isotropy']:.4f} -> {results['isotropy']:.4f} "
        f"in {results['seconds']:.0f}s -> {run}"
    )
    return results


def _results(cfg: FitConfig, history: list[dict], final_stage: str, seconds: float) -> dict:
    initial = next(r for r in history if r["stage"] == "initial")
    final = [r for r in history if r["stage"] == final_stage][-1]
    keys = ("recall@1", "map", "map_at_r", "isotropy")
    first = FIRST_STAGE[cfg.method]
    return {
        "method": cfg.method,
        "epochs": cfg.epochs,
        "probe_epochs": cfg.probe_epochs if cfg.method == "lacvit" else 0,
        "seed": cfg.seed,
        "top1": final.get("top1"),
        **{k: final[k] for k in keys},
        **{f"initial_{k}": initial[k] for k in keys},
        "train_seconds": round(
            sum(r.get("train_seconds", 0.0) for r in history if r["stage"] == first), 1
        ),
        "probe_seconds": round(
            sum(r.get("train_seconds", 0.0) for r in history if r["stage"] == "probe"), 1
        ),
        "seconds": round(seconds, 1),
    }
