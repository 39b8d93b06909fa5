"""`fit`: metric-learning training of an EmbeddingModel with held-out evaluation, and
what every `fit --method` starts with.

One epoch = a pass over the training split in shuffled batches (AdamW, warm-up +
cosine schedule per step, gradient clipping, AMP on CUDA: training/epochs.py), then
leave-one-out retrieval metrics on the held-out split, a checkpoint, one line of
`metrics.jsonl` and a refreshed `curves.png` (training/run_folder.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from vitrieval.index.evaluation.datasets import Split

from .amp import MixedPrecision
from .config import LOSS_OPTIONS, FitConfig, dataset_split
from .data import (
    ImageDataset,
    build_transforms,
    decoded_as_exported,
    drop_unreadable,
    epoch_loader,
)
from .decode_cache import DecodeCache
from .device import describe_device, pick_device
from .epochs import Stage, seed_everything, train_run
from .evaluate import evaluate_retrieval
from .losses import create_loss
from .model import EmbeddingModel
from .optim import param_groups
from .plots import plot_curves
from .progress import EpochClock, finished_line
from .run_folder import (
    CURVES_FILE,
    TrainingError,
    claim_run_folder,
    init_weights,
    json_metric,
    model_from_config,
    save_config,
    show_metric,
    start_or_resume,
    write_skipped,
)

Prepared = tuple[Path, torch.device, EmbeddingModel, Split, list, list]
"""What `prepare_run` returns: run folder, device, model, split, readable training and
held-out items."""


def load_split(cfg: FitConfig, image_size: int) -> Split:
    split = dataset_split(cfg, image_size)
    if len(split.train_classes()) < 2:
        raise TrainingError(f"{split.name}: the training split needs at least 2 classes")
    return split


def prepare_run(cfg: FitConfig, resume: bool) -> Prepared:
    """What every `fit` method starts with: the run folder (refused if it holds a run
    and `resume` is off), the device, the seeded model on it (with `--init` weights and
    `--freeze-backbone`), the split, and its readable training and held-out items
    (unreadable ones listed in RUN/skipped.txt). A split that holds nothing out
    (`--test-fraction 0`) gives no held-out items, and says so."""
    run = Path(cfg.out)
    claim_run_folder(run, resume)
    run.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    seed_everything(cfg.seed)
    model = model_from_config(cfg, load_pretrained=not resume)
    if cfg.init and not resume:
        init_weights(model, cfg.init)
    if cfg.freeze_backbone:
        model.backbone.requires_grad_(False)
    model = model.to(device)
    data_config = model.data_config()
    split = load_split(cfg, image_size=data_config["input_size"][-1])
    # the readability check decodes every file: the decode cache keeps what it decoded
    cache = DecodeCache.for_run(
        cfg.decode_cache, cfg.decode_cache_dir, run, data_config, cfg.crop_scale
    )
    train_items, bad_train = drop_unreadable(split.train, "training images", cache)
    # held-out images skip the cache: decoded as the exported model's Embedder decodes
    # them, the run's figures are the ones `vitrieval-index bench` measures
    test_items, bad_test = drop_unreadable(
        decoded_as_exported(split.test, data_config), "held-out images"
    )
    if cache is not None and (cache.stats.decoded or cache.stats.reused):
        print(cache.summary())
    write_skipped(run, bad_train + bad_test)
    if not train_items:
        raise TrainingError(f"{split.name}: no readable training images")
    classes = len({item.label for item in train_items})
    if cfg.sampler == "pk" and cfg.classes_per_batch > classes:
        raise TrainingError(
            f"--classes-per-batch {cfg.classes_per_batch} is larger than the {classes} classes "
            f"of {split.name}'s training images (the P x K sampler needs P distinct classes)"
        )
    if split.test and not test_items:
        raise TrainingError(f"{split.name}: no readable held-out images to evaluate on")
    if not split.test:
        print(
            f"no held-out split (--test-fraction 0): training on all {len(train_items)} "
            "images, no evaluation"
        )
    return run, device, model, split, train_items, test_items


def fit(cfg: FitConfig, resume: bool = False) -> dict:
    """Train per `cfg` into the run folder `cfg.out`; returns the last epoch's metrics
    (with `--method lacvit | ce`, the run's results). Ctrl-C or SIGTERM stops it cleanly
    (training/epochs.py's `train_run`)."""
    return train_run(cfg, "fit", lambda cfg: _fit(cfg, resume))


def _fit(cfg: FitConfig, resume: bool) -> dict:
    prepared = prepare_run(cfg, resume)
    if cfg.method != "metric":  # LaCViT and its cross-entropy baseline: training/lacvit.py
        from .lacvit import fit_method

        return fit_method(cfg, prepared, resume)
    return _fit_metric(cfg, prepared, resume)


def _fit_metric(cfg: FitConfig, prepared: Prepared, resume: bool) -> dict:
    """`fit --method metric` (a resolved, validated config)."""
    run, device, model, split, train_items, test_items = prepared
    data_config = model.data_config()
    classes = sorted({item.label for item in train_items})
    class_to_index = {name: i for i, name in enumerate(classes)}

    loss_options = {name: getattr(cfg, name) for name in LOSS_OPTIONS.get(cfg.loss, ())}
    loss_fn = create_loss(cfg.loss, model.embedding_dim, len(classes), **loss_options).to(device)
    groups = param_groups(model, loss_fn, cfg.weight_decay, cfg.layer_decay, cfg.proxy_lr_scale)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999))

    state, start_epoch, history = start_or_resume(run, model, loss_fn, optimizer, resume)
    save_config(run, cfg)

    train_tf, eval_tf = build_transforms(data_config, cfg.crop_scale, cfg.hflip, cfg.auto_augment)
    dataset = ImageDataset(train_items, class_to_index, train_tf)
    amp = MixedPrecision(cfg.amp, device)
    amp.restore(state)
    stage = Stage.of(cfg, "epoch", len(epoch_loader(dataset, cfg, 1)), optimizer, [model], amp)
    if history and start_epoch >= cfg.epochs:  # `--resume` of a finished run
        print(finished_line(run, start_epoch, cfg.epochs, history[-1]))
        return history[-1]
    print(
        f"training {cfg.backbone}+{cfg.pool} on {split.name} ({len(train_items)} train / "
        f"{len(test_items)} held-out images, {len(classes)} classes) on "
        f"{describe_device(device, amp.active_dtype)}"
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int, dict]:
        images, labels = batch
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with amp.autocast():
            loss = loss_fn(model(images), labels)
        return loss, len(labels), {}

    started = time.perf_counter()
    clock = EpochClock(start_epoch, cfg.epochs)
    row: dict = history[-1] if history else {}
    if cfg.epochs == 0 and not history:
        # --epochs 0: the initial model, evaluated and saved as the run's epoch 0
        row = {"epoch": 0, "loss": None, "lr": None}
        row.update(held_out_scores(model, test_items, eval_tf, cfg, device))
        stage.commit(run, model, loss_fn, cfg, row, history)
        plot_curves(history, run / CURVES_FILE)
        print(f"epoch 0 (the initial model): {scores_text(row) or 'no evaluation'}".rstrip())
    for epoch, _ in stage.epochs_after(start_epoch):
        loader = epoch_loader(dataset, cfg, epoch, pin_memory=device.type == "cuda")
        done = stage.train_epoch(epoch, loader, step)
        row = {
            "epoch": epoch,
            "loss": done.mean("loss"),
            "lr": done.lr,
            **held_out_scores(model, test_items, eval_tf, cfg, device),
            **done.timings(),
        }
        stage.commit(run, model, loss_fn, cfg, row, history)
        plot_curves(history, run / CURVES_FILE)
        print(
            f"epoch {epoch}/{cfg.epochs}  loss {row['loss']:.4f}  {scores_text(row)}"
            f"lr {done.lr:.2e}  {done.seconds:.1f}s "
            f"({row['train_images_per_s']:.0f} img/s)  {clock.text(epoch)}"
        )
    elapsed = time.perf_counter() - started
    if row:
        measured = (
            f"held-out R@1 {show_metric(row['recall@1'])} mAP {show_metric(row['map'])} "
            f"MAP@R {show_metric(row['map_at_r'])}"
            if "recall@1" in row
            else "no held-out evaluation"
        )
        print(f"done: {cfg.epochs} epochs, {measured} in {elapsed:.0f}s -> {run}")
    return row


def held_out_scores(
    model: torch.nn.Module, items: list, transform: Callable, cfg: FitConfig, device: torch.device
) -> dict:
    """The held-out retrieval metrics of `items`, JSON-ready (NaN as None); nothing
    when there are no held-out items (`--test-fraction 0`)."""
    if not items:
        return {}
    scores = evaluate_retrieval(model, items, transform, cfg.eval_batch_size, device)
    return {k: json_metric(v) for k, v in scores.items()}


def scores_text(row: dict) -> str:
    """R@1 and mAP of a metrics row for the console ("" when nothing was evaluated)."""
    if "recall@1" not in row:
        return ""
    return f"R@1 {show_metric(row['recall@1'])}  mAP {show_metric(row['map'])}  "
