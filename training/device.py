"""The device a training command runs on: picked from `--device`, and named in the log."""

from __future__ import annotations

import logging

import torch

from .config import ConfigError

logger = logging.getLogger("vitrieval.train")


def pick_device(name: str) -> torch.device:
    """The torch device for `name`: with "auto", CUDA when torch sees a device, else the
    CPU (logged with the reason); "cuda" without a device is a ConfigError, not a CPU run."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device cuda asked for, but no CUDA device is available ({_no_cuda_reason()})"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cpu":
            logger.info("device auto: %s; training on the CPU", _no_cuda_reason())
    return torch.device(name)


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def describe_device(device: torch.device, amp_dtype: torch.dtype | None = None) -> str:
    """One line for the log: "cuda:0 (NVIDIA H100 80GB HBM3) with AMP bfloat16", "cpu"."""
    text = str(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        text = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if amp_dtype is not None:
        text += f" with AMP {str(amp_dtype).removeprefix('torch.')}"
    return text
