"""The run folder: the name of every file a training run writes, and the helpers that
read and write them (docs/training.md, "The run folder").

    RUN/config.yaml            CONFIG_FILE      the FitConfig of the run's embedding model
    RUN/pretrain.yaml          PRETRAIN_FILE    `pretrain` only: its PretrainConfig
    RUN/metrics.jsonl          METRICS_FILE     one JSON row per epoch, appended and fsynced
    RUN/curves.png             CURVES_FILE      the rows as curves
    RUN/model.safetensors      RUN_MODEL_FILE   the embedding model after the last epoch
    RUN/skipped.txt            SKIPPED_FILE     images that could not be decoded
    RUN/checkpoint/            CHECKPOINT_DIR   what `--resume` reads:
        state.json             STATE_FILE       the commit: epoch, config, the files below
        {model,loss,optimizer}-<epoch>.safetensors   (checkpoint_files)
    RUN/initial.safetensors    INITIAL_FILE     `--method lacvit | ce`: the encoder before training
    RUN/classifier.safetensors CLASSIFIER_FILE  `--method lacvit | ce`: the linear classifier
    RUN/results.json           RESULTS_FILE     `--method lacvit | ce`: the run's results
    RUN/decode-cache/          training/decode_cache.py's CACHE_DIRNAME

A checkpoint writes its epoch's files under new names, then `state.json` (atomically)
names them, and only then are the previous epoch's files deleted: a crash at any moment
leaves `state.json` pointing at one complete epoch. `RUN/model.safetensors` is a hard
link to the checkpoint's model file, so the weights are written once per epoch. The
random state needs no saving: every epoch reseeds from (seed, epoch)
(training/epochs.py), so a resumed run draws the batches an unbroken one would.

Importing this module imports neither torch nor timm (the command line reads the names
before any training starts): the helpers that need them import them when called.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitrieval.index.atomic import atomic_write_text

from .config import POOL_OPTIONS, FitConfig, load_config_file

if TYPE_CHECKING:
    import torch

    from .model import EmbeddingModel

CONFIG_FILE = "config.yaml"
PRETRAIN_FILE = "pretrain.yaml"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
RUN_MODEL_FILE = "model.safetensors"
SKIPPED_FILE = "skipped.txt"
CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.json"
CHECKPOINT_PARTS = ("model", "loss", "optimizer")
INITIAL_FILE = "initial.safetensors"
CLASSIFIER_FILE = "classifier.safetensors"
RESULTS_FILE = "results.json"


class TrainingError(RuntimeError):
    """A run that cannot proceed (no data, empty classes, a run folder in the way)."""


# -- claiming and resuming ------------------------------------------------------------


def claim_run_folder(run: Path, resume: bool, stage: str | None = None, kind: str = "") -> None:
    """Refuse a run folder that holds a run unless resuming it, and (with `stage`) a
    checkpoint of another kind of run: its heads would not load, with a long message."""
    state_file = run / CHECKPOINT_DIR / STATE_FILE
    if not resume and state_file.exists():
        raise TrainingError(
            f"{run} already holds a run; pass --resume to continue it or choose another --out"
        )
    saved_stage = (
        json.loads(state_file.read_text()).get("stage")
        if resume and stage and state_file.is_file()
        else stage
    )
    if saved_stage != stage:
        raise TrainingError(f"{run}'s checkpoint is not a {kind} run; cannot resume it")


def start_or_resume(
    run: Path,
    model: torch.nn.Module,
    head: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    resume: bool,
    keep: Callable[[dict, int], bool] | None = None,
    label: str = "epoch",
) -> tuple[dict | None, int, list[dict]]:
    """(checkpoint state or None, epochs done, metrics history) for a run about to train.

    With `resume`, loads the checkpoint into model, head (loss or heads) and optimizer.
    RUN/metrics.jsonl is then cut back to the rows `keep(row, epochs_done)` accepts
    (default: epochs up to the checkpoint; rows of an epoch that died after logging are
    dropped) and rewritten, so the run appends to a consistent history.
    """
    state, done = None, 0
    if resume:
        state = load_checkpoint(run, model, head, optimizer)
        done = int(state["epoch"])
        print(f"resuming {run} after {label} {done}")
    keep = keep or (lambda row, epoch: row["epoch"] <= epoch)
    history = [row for row in read_metrics(run) if keep(row, done)]
    atomic_write_text(run / METRICS_FILE, "".join(json.dumps(row) + "\n" for row in history))
    return state, done, history


def save_config(run: Path, cfg: Any) -> None:
    """RUN/config.yaml, the FitConfig that `export`, `analyze`, `fit --init` and `fit
    --resume` read; for a PretrainConfig first RUN/pretrain.yaml, which `pretrain
    --resume` reads, then its embedding model's FitConfig as RUN/config.yaml."""
    if isinstance(cfg, FitConfig):
        cfg.save(run / CONFIG_FILE)
    else:
        cfg.save(run / PRETRAIN_FILE)
        cfg.embedding_config().save(run / CONFIG_FILE)


def read_config(run: Path) -> FitConfig:
    """The FitConfig in RUN/config.yaml."""
    return FitConfig(**load_config_file(run / CONFIG_FILE))


def write_skipped(run: Path, skipped: list[tuple[str, str]]) -> None:
    """RUN/skipped.txt, one `key<TAB>reason` line per unreadable image, and one line on
    the console (nothing when every image was readable)."""
    if skipped:
        path = run / SKIPPED_FILE
        atomic_write_text(path, "".join(f"{key}\t{reason}\n" for key, reason in skipped))
        print(f"skipped {len(skipped)} unreadable images (listed in {path})")


# -- metrics rows ---------------------------------------------------------------------


def read_metrics(run: Path) -> list[dict]:
    """The rows of RUN/metrics.jsonl (none when there is no such file)."""
    path = run / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_metrics(run: Path, row: dict) -> None:
    """Append one row to RUN/metrics.jsonl, fsynced."""
    with open(run / METRICS_FILE, "a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def json_metric(value: float | int) -> float | int | None:
    """JSON has no NaN: metrics undefined on a split (no valid query) become null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def show_metric(value: float | None) -> str:
    """A metric for the console; None when no held-out query had a same-class neighbour."""
    return "n/a" if value is None else f"{value:.4f}"


# -- checkpoints ----------------------------------------------------------------------


def checkpoint_files(epoch: int) -> dict[str, str]:
    """The names of an epoch's checkpoint files in RUN/checkpoint, by part."""
    return {part: f"{part}-{epoch}.safetensors" for part in CHECKPOINT_PARTS}


def save_checkpoint(
    run: Path,
    model: torch.nn.Module,
    loss: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
) -> None:
    """Write this epoch's files, link the model weights, then commit with `state.json`."""
    from .checkpoint import link_replace, save_optimizer, save_tensors

    folder = run / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(state["epoch"])
    save_tensors(folder / files["model"], model.state_dict())
    save_tensors(folder / files["loss"], loss.state_dict())
    save_optimizer(folder / files["optimizer"], optimizer)
    link_replace(folder / files["model"], run / RUN_MODEL_FILE)
    atomic_write_text(folder / STATE_FILE, json.dumps({**state, "files": files}))
    for stale in folder.glob("*.safetensors"):
        if stale.name not in files.values():
            stale.unlink()


def load_checkpoint(
    run: Path, model: torch.nn.Module, loss: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """Restore model, loss and optimiser from RUN/checkpoint; returns the saved state dict."""
    from .checkpoint import CheckpointError, load_loss_state, load_model_weights, load_optimizer

    folder = run / CHECKPOINT_DIR
    if not (folder / STATE_FILE).is_file():
        raise CheckpointError(f"{run} has no checkpoint to resume from")
    state = json.loads((folder / STATE_FILE).read_text())
    files = state["files"]
    load_model_weights(model, folder / files["model"])
    load_loss_state(loss, folder / files["loss"])
    load_optimizer(folder / files["optimizer"], optimizer)
    return state


# -- the run's model ------------------------------------------------------------------


def model_from_config(cfg: FitConfig, load_pretrained: bool = True) -> EmbeddingModel:
    """The EmbeddingModel `cfg` describes (its backbone weights from `cfg.pretrained`
    only with `load_pretrained`)."""
    from .model import build_model

    pool_options = {
        option: getattr(cfg, field)
        for option, field in POOL_OPTIONS.get(cfg.pool, {}).items()
        if getattr(cfg, field) is not None
    }
    return build_model(
        cfg.backbone,
        cfg.pool,
        dim=cfg.dim,
        pretrained=cfg.pretrained if load_pretrained else None,
        pool_options=pool_options,
        drop_path_rate=cfg.drop_path,
    )


def load_run_model(run: Path) -> tuple[EmbeddingModel, FitConfig]:
    """The model of a run folder, rebuilt from RUN/config.yaml with RUN/model.safetensors
    loaded, in eval mode, and its config."""
    from .checkpoint import load_model_weights

    cfg = read_config(run)
    model = model_from_config(cfg, load_pretrained=False)
    load_model_weights(model, run / RUN_MODEL_FILE)
    return model.eval(), cfg


def init_weights(model: EmbeddingModel, run: str) -> None:
    """`--init RUN`: the backbone and every head tensor that fits from RUN's model."""
    from .checkpoint import load_init_weights

    fresh = load_init_weights(model, Path(run) / RUN_MODEL_FILE)
    heads = sorted({name.split(".")[0] for name in fresh})
    note = f"; {', '.join(heads)} newly initialised ({len(fresh)} tensors)" if fresh else ""
    print(f"initialised from {run}{note}")
