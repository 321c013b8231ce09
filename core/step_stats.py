"""A step's numbers (loss, gradient norm) read without stalling the GPU.

Reading a CUDA tensor's value (``.item()``, ``float()``) waits for every kernel queued so far,
and while Python waits it queues nothing: a loop that reads its loss, accuracy and gradient norm
every step leaves the GPU idle for a large share of ResNet-18's step (benchmarks/README.md, GPU).
So the loop keeps a step's numbers as tensors in a :class:`PendingStep`, and a
:class:`StepReader` reads them all at once:

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

from core.curves import StepLog
from core.distributed import DistContext
from core.reporting import Decision, Reporter
from core.results import Stop


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
    _ready: torch.cuda.Event | None = field(default=None, init=False, repr=False)  # CUDA event after the copy

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
            assert self._ready is not None  # stage() records it with the copy
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


class StepReader:
    """The loop's per-step numbers: each optimizer step's micro-batch losses and gradient norm,
    read ``lag`` steps late (see the module docstring), checked for divergence, added to the
    epoch's sums, kept in ``step_log`` and reported; under DDP every rank gets rank 0's decision.

    Each epoch: :meth:`start_epoch`; per micro-batch :meth:`add`; per optimizer step
    :meth:`before_update` (gradients final, weights not yet touched) and :meth:`after_update`
    (weights and learning rate updated); after the epoch's last step :meth:`finish_epoch`. The last
    three return a :class:`Stop` when the run must end (divergence, or the reporter's interrupt),
    else None. The epoch's sums (``loss_sum``, ``seen``: this rank's samples) and
    the last read step's ``grad_norm`` are then complete."""

    def __init__(self, lag: int, reporter: Reporter, step_log: StepLog, ctx: DistContext,
                 device: torch.device, check_grad: bool) -> None:
        self.lag, self.reporter, self.step_log, self.ctx, self.device = lag, reporter, step_log, ctx, device
        self.check_loss = not ctx.enabled  # DDP ranks see different losses; the gradient norm is all-reduced
        self.check_grad = check_grad
        self.epoch = 0
        self.loss_sum = self.seen = 0.0
        self.grad_norm = math.nan
        self._current = PendingStep(1, 0)  # the step being accumulated
        self._pending: PendingStep | None = None  # lag 1: an updated step whose numbers are not yet read
        self._decision = Decision.CONTINUE  # the reporter's answer for the last reported step
        self.diverged: PendingStep | None = None  # the non-finite step, once read (core/forensics.py)

    def start_epoch(self, epoch: int, step: int, loss_sum: float, seen: float, grad_norm: float = math.nan) -> None:
        """``epoch`` starts after optimizer step ``step``, with the sums of its micro-batches
        trained before an interrupt and the last read step's gradient norm (zeros and NaN for a
        fresh epoch): an epoch resumed after its last step reports the norm the straight run does."""
        self.epoch, self.loss_sum, self.seen = epoch, loss_sum, seen
        self.grad_norm = grad_norm
        self._pending = None
        self._current = PendingStep(step + 1, epoch)

    def add(self, loss: torch.Tensor, size: int) -> None:
        """One micro-batch's mean loss (left on the device) over ``size`` samples."""
        self._current.add(loss, size)
        self.seen += size

    def before_update(self, grad_norm: torch.Tensor | float) -> Stop | None:
        """The step's gradients are final (``grad_norm`` measured). Read a step before the
        optimizer touches the weights, this one (lag 0) or the one before (lag 1, reported now)."""
        self._current.grad_norm = grad_norm
        self._current.stage()
        self._decision = Decision.CONTINUE
        previous, self._pending = (self._current if self.lag == 0 else self._pending), None
        if previous is None:
            return None
        problem = self._read(previous)
        if problem:
            return Stop("diverged", problem)
        if self.lag:
            self._decision = self._report(previous)
        return None

    def after_update(self, lr: float) -> Stop | None:
        """The optimizer (and a per-step scheduler) stepped; ``lr`` is the learning rate now.
        Lag 0: report the step. Lag 1: it waits to be read during the next one."""
        done = self._current
        done.lr = lr
        if self.lag == 0:
            self._decision = self._report(done)
        else:
            self._pending = done
        self._current = PendingStep(done.step + 1, self.epoch)
        return self._interrupted(done.step) if self._decision is Decision.INTERRUPT else None

    def finish_epoch(self) -> Stop | None:
        """After the epoch's last step (or a stop): read and report the step still pending (lag 1),
        Its divergence outranks an interrupt already asked for."""
        stop = None
        if self._pending is not None:
            done, self._pending = self._pending, None
            problem = self._read(done)
            if problem:
                stop = Stop("diverged", problem)
            elif self._report(done) is Decision.INTERRUPT:
                stop = self._interrupted(done.step)
        return stop

    def _read(self, done: PendingStep) -> str | None:
        """Read a step's numbers (the one host-device sync of a step) and say if it diverged."""
        done.read()
        problem = done.problem(check_loss=self.check_loss, check_grad=self.check_grad)
        if problem:
            self.diverged = done
        return problem

    def _report(self, done: PendingStep) -> Decision:
        """Add a read step to the epoch's sums and report it; every rank gets rank 0's decision."""
        group_loss = sum(v * n for v, n in zip(done.loss_values, done.sizes, strict=True))
        group_n: float = sum(done.sizes)
        self.loss_sum, self.grad_norm = self.loss_sum + group_loss, done.norm_value
        if self.ctx.enabled:  # the step loss over the global batch, not rank 0's shard
            group_loss, group_n = self.ctx.all_reduce_sum([group_loss, group_n], self.device)
        metrics = {"train_loss": group_loss / group_n, "lr": done.lr, "grad_norm": self.grad_norm}
        self.step_log.add(done.step, metrics)
        return self.ctx.agree(self.reporter.report_step(done.step, metrics), self.device)

    def _interrupted(self, step: int) -> Stop:
        return Stop("interrupted", f"interrupted at step {step} (epoch {self.epoch}); checkpoint saved")
