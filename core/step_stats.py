"""A step's numbers (loss, gradient norm) read without stalling the GPU.

Reading a CUDA tensor's value (``.item()``, ``float()``) waits for every kernel queued so far,
and while Python waits it queues nothing: a loop that reads its loss, accuracy and gradient norm
every step leaves the GPU idle for a large share of ResNet-18's step (benchmarks/README.md, GPU).
So the loop keeps a step's numbers as tensors in a :class:`PendingStep` and reads them all
at once:

* lag 0 (CPU, where nothing is queued, and DDP, where every rank must act on the same step):
  read before the optimizer step, so a non-finite loss or gradient stops the run before it
  touches the weights;
* lag 1 (one CUDA device): step k is read while step k+1's kernels are queued, so the GPU always
  has work. A non-finite step then stops the run one step later: the weights in memory are
  spoiled, but the checkpoints on disk are written only after every step is read, so none holds them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def gradient_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor | float:
    """The total 2-norm of ``grads`` (what ``clip_grad_norm_`` measures), for the per-step curve
    and the divergence check, computed without clipping anything.

    On CUDA it stays a tensor (read later with the step's other numbers). On CPU it is a float
    from the per-tensor norms: ``get_total_norm`` also groups the tensors by device and dtype and
    reduces the norms in two more tensor ops, a measurable share of a small CPU model's step;
    this path is cheaper (benchmarks/README.md, trainer overhead).
    ``math.hypot`` keeps a non-finite norm non-finite (inf wins over nan, as in IEEE hypot)."""
    if device.type != "cpu" or not grads:
        return torch.nn.utils.get_total_norm(grads)
    return math.hypot(*[float(n) for n in torch._foreach_norm(grads)])


def read_lag(device: torch.device, distributed: bool) -> int:
    """Steps between queuing a step and reading its numbers (see the module docstring)."""
    return 1 if device.type == "cuda" and not distributed else 0


@dataclass
class PendingStep:
    """One optimizer step's numbers, still on the device."""

    step: int
    epoch: int
    losses: list[torch.Tensor] = field(default_factory=list)  # each micro-batch's mean loss
    sizes: list[int] = field(default_factory=list)  # each micro-batch's sample count
    grad_norm: torch.Tensor | float | None = None  # a float where it was computed on the host
    lr: float = math.nan  # after the step (and the scheduler's step), like the per-step curve shows
    loss_values: list[float] = field(default_factory=list)  # filled by read()
    norm_value: float = math.nan  # filled by read()
    _host: torch.Tensor | None = field(default=None, init=False, repr=False)  # staged copy
    _ready: object = field(default=None, init=False, repr=False)  # CUDA event after the copy

    def add(self, loss: torch.Tensor, size: int) -> None:
        self.losses.append(loss.detach())
        self.sizes.append(size)

    def stage(self) -> None:
        """Called once the step's numbers are queued: on CUDA, start copying them to the host,
        into pinned memory behind an event, so :meth:`read` later waits for this step's kernels
        only, not for whatever was queued after it (a plain ``.tolist()`` would). On CPU nothing
        is queued and :meth:`read` takes the values directly (cheaper than a stack)."""
        device = self.losses[0].device
        if device.type != "cuda":
            return
        norm = torch.as_tensor(self.grad_norm if self.grad_norm is not None else math.nan)
        values = torch.stack([t.float().reshape(()) for t in self.losses]
                             + [norm.detach().float().reshape(()).to(device)])
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def read(self) -> tuple[list[float], float]:
        """Fill ``loss_values`` and ``norm_value`` (and return them): at most one host-device sync."""
        if self._host is None and self.losses[0].device.type == "cuda":
            self.stage()
        if self._host is None:  # CPU
            self.loss_values = [float(t) for t in self.losses]
            self.norm_value = float(self.grad_norm) if self.grad_norm is not None else math.nan
        else:
            self._ready.synchronize()
            *self.loss_values, self.norm_value = self._host.tolist()
        return self.loss_values, self.norm_value

    def problem(self, check_loss: bool, check_grad: bool) -> str | None:
        """After :meth:`read`: why this step means divergence, or None. Under DDP the loss is not
        checked (ranks would disagree); the all-reduced gradient norm is the same on every rank."""
        where = f"at step {self.step} (epoch {self.epoch})"
        if check_loss:
            for value in self.loss_values:
                if not math.isfinite(value):
                    return f"non-finite loss {value} {where}"
        if check_grad and not math.isfinite(self.norm_value):
            return f"non-finite gradient norm {self.norm_value} {where}"
        return None
