"""Precision: owns autocast, the fp16 GradScaler and its state (after Lightning Fabric)."""
from __future__ import annotations

import contextlib

import torch

from core.config import ConfigError


def resolve_precision(setting: str, device: torch.device) -> str:
    """``auto`` -> bf16 on a CUDA device that supports it, else fp32.
    fp16 needs CUDA: on CPU it is an error (bf16 is the CPU's mixed precision)."""
    if setting == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if setting == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision: 'fp16' needs a CUDA device; on CPU use 'bf16' or 'fp32'")
    return setting


class Precision:
    """Autocast context, loss scaling and overflow-skip accounting for one run."""

    def __init__(self, setting: str, device: torch.device) -> None:
        self.name = resolve_precision(setting, device)
        self.device = device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)
        # The scaler only matters for fp16: bf16 has fp32's exponent range.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.name == "fp16")
        self.skipped_steps = 0

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place so clipping and the grad norm see true values."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer (unless fp16 overflowed) and update the scale.
        Returns False when the step was skipped for an overflow; such steps are counted."""
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler lowers the scale exactly when it skipped the step for inf/NaN grads.
        skipped = self.scaler.get_scale() < scale_before
        self.skipped_steps += int(skipped)
        return not skipped

    @property
    def tolerates_nonfinite_grads(self) -> bool:
        """fp16 overflow is expected and handled by skipping; elsewhere a non-finite grad is divergence."""
        return self.scaler.is_enabled()

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
