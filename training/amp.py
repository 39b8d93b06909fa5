"""Mixed precision for the training loops (`fit`, `fit --method lacvit | ce`, `pretrain`).

On CUDA with `--amp`, forward passes run under autocast in bfloat16 where the GPU has
it, else in float16 with a gradient scaler (float16's range needs the loss scaled up
before backward); on the CPU, or without `--amp`, everything stays float32 and the
scaler is a no-op. The scaler's state travels in the checkpoint (`state()` /
`restore()`), so a resumed float16 run continues with the scale an unbroken one had.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from .checkpoint import restore_scaler, scaler_state


class MixedPrecision:
    """`autocast()` for the forward pass, `optimizer_step()` for the backward pass."""

    def __init__(self, enabled: bool, device: torch.device, dtype: torch.dtype | None = None):
        """dtype: the autocast type; None picks bfloat16 where the GPU has it, else float16."""
        self.on = enabled and device.type == "cuda"
        if dtype is None:
            bf16 = self.on and torch.cuda.is_bf16_supported()
            dtype = torch.bfloat16 if bf16 else torch.float16
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.on and self.dtype == torch.float16)

    @property
    def active_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None when running in float32 (for the log line)."""
        return self.dtype if self.on else None

    def autocast(self) -> AbstractContextManager:
        return torch.autocast("cuda", dtype=self.dtype) if self.on else nullcontext()

    def optimizer_step(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_params: Iterable[torch.Tensor],
        clip_grad: float | None,
    ) -> None:
        """Zero the gradients, backpropagate the (scaled) loss, clip the gradient norm of
        `clip_params` to `clip_grad` (on the unscaled gradients; None or 0: no clipping),
        and step."""
        optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if clip_grad:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(clip_params, clip_grad)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state(self) -> dict:
        """The scaler's state for the checkpoint's state.json (empty when off)."""
        return scaler_state(self.scaler)

    def restore(self, state: dict | None) -> None:
        """Load `state()`'s record from a checkpoint's state (nothing if absent or off)."""
        restore_scaler(self.scaler, state)
