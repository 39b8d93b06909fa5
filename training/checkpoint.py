"""Weights, loss state and optimiser state as safetensors files (loading runs no code),
written atomically; the loss scaler's state as JSON.

Which files make a run folder's checkpoint, and in which order they commit, is
training/run_folder.py's. The optimiser state is flattened into tensors named
`state.<param index>.<key>`; its param-group settings travel as JSON in the
safetensors metadata.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from vitrieval.index.atomic import atomic_write_bytes, fsync_dir


class CheckpointError(ValueError):
    """A checkpoint that is missing or does not fit the model."""


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    payload = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path, save(payload, metadata=metadata))


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"no weights at {path}")
    try:
        model.load_state_dict(load_file(str(path)))
    except Exception as exc:  # unreadable file or tensors that do not fit
        raise CheckpointError(f"{path} cannot be loaded into the model: {exc}") from None


def load_init_weights(model: torch.nn.Module, path: Path) -> list[str]:
    """`--init RUN`: the backbone from `path` (every tensor of it, or an error), and
    each head tensor (pooling, projection) that `path` holds with the same shape.

    The run may come from another pooling or from `pretrain` (whose model is the
    backbone with average pooling): a new head starts from its own initialisation
    rather than refusing the run. Returns the names of the tensors left at their
    initialisation.
    """
    if not path.is_file():
        raise CheckpointError(f"no weights at {path}")
    try:
        saved = load_file(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    own = model.state_dict()
    backbone = [k for k in own if k.startswith("backbone.")]
    missing = [k for k in backbone if k not in saved]
    misfit = [k for k in backbone if k in saved and saved[k].shape != own[k].shape]
    if missing or misfit:
        what = f"lacks {missing[0]}" if missing else f"has {misfit[0]} of another shape"
        raise CheckpointError(
            f"{path} does not hold this backbone ({what}; "
            f"{len(missing) + len(misfit)} of {len(backbone)} tensors do not fit)"
        )
    taken = {k: v for k, v in saved.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(taken, strict=False)
    return sorted(k for k in own if k not in taken)


def _flatten_optimizer(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {
        "param_groups": json.dumps(state["param_groups"]),
        "scalars": json.dumps(scalars),
    }


def _unflatten_optimizer(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for index, entries in json.loads(metadata.get("scalars", "{}")).items():
        state.setdefault(int(index), {}).update(entries)
    return {"state": state, "param_groups": json.loads(metadata["param_groups"])}


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    tensors, metadata = _flatten_optimizer(optimizer)
    save_tensors(path, tensors, metadata)


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata() or {}
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    optimizer.load_state_dict(_unflatten_optimizer(tensors, metadata))


def load_loss_state(loss: torch.nn.Module, path: Path) -> None:
    """A checkpoint's `loss` part (the proxies, or a method's heads) into `loss`."""
    try:
        loss.load_state_dict(load_file(str(path)))
    except Exception as exc:  # e.g. --resume with another dataset: other class count
        raise CheckpointError(f"the checkpoint's loss state does not fit this run: {exc}") from None


def scaler_state(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """The fp16 loss scale and its growth counter, for `state.json` (empty when off): a
    resumed fp16 run continues with the scale the unbroken one would have."""
    return scaler.state_dict() if scaler.is_enabled() else {}


def restore_scaler(scaler: torch.amp.GradScaler, state: dict | None) -> None:
    """Load `scaler_state`'s record from a checkpoint's state (nothing if absent or off)."""
    saved = (state or {}).get("grad_scaler")
    if saved and scaler.is_enabled():
        scaler.load_state_dict(saved)


def link_replace(source: Path, target: Path) -> None:
    """Make `target` a hard link to `source` (a copy where links are not supported),
    replacing it atomically."""
    tmp = target.with_name(f".{target.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)
