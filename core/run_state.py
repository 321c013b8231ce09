"""What a run carries from epoch to epoch and across a restart, and the checkpoint that holds it.

:class:`RunState` is the loop's bookkeeping: optimizer steps so far, the best monitored value,
the per-epoch history, every reported step, and where an epoch interrupted mid-way stopped.
:class:`RunCheckpoints` writes it to ``last.pt`` (and ``best.pt``) together with the weights,
optimizer, scheduler, scaler and RNG states, and reads all of it back, so that a resumed run
continues bitwise-identically.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from core import checkpoint as ckpt
from core.config import TrainConfig
from core.curves import StepLog, epoch_reports
from core.precision import Precision
from core.seeding import rng_state, set_rng_state
from core.tasks.base import Task


@dataclass
class RunState:
    """A run's counters and curves; a fresh run's by default."""

    start_epoch: int = 1  # the first epoch this process trains
    step: int = 0  # optimizer steps so far
    best: float | None = None  # the best monitored value so far, and its epoch
    best_epoch: int | None = None
    history: list[dict] = field(default_factory=list)  # per epoch: {"epoch", "step", **metrics}
    step_log: StepLog = field(default_factory=StepLog)  # every reported step, for a resumed run's reporter
    # An epoch interrupted mid-way: {"next_batch", "world_size", "sums": (loss, seen, seconds), "grad_norm"}.
    progress: dict | None = None

    def last_metrics(self) -> dict[str, float]:
        """The last epoch's metrics ({} before the first epoch)."""
        return epoch_reports(self.history)[-1][2] if self.history else {}

    def take_progress(self, is_main: bool) -> tuple[int, tuple[float, float, float, float]]:
        """Where the next epoch starts: the first micro-batch to train, the sums (loss, seen,
        seconds) of those trained before an interrupt and the last step's gradient norm; for a
        fresh epoch 0, zeros and NaN. Taken once: the epochs after it start from their beginning."""
        progress, self.progress = self.progress, None
        skip = progress["next_batch"] if progress else 0
        sums = tuple(progress["sums"]) if progress else (0.0, 0.0, 0.0)
        if len(sums) == 4:  # a checkpoint written before train accuracy was dropped: (loss, correct, seen, s)
            sums = (sums[0], sums[2], sums[3])
        loss_sum, seen, seconds = sums
        if not is_main:  # the checkpoint's partial sums are already summed over ranks
            loss_sum, seen = 0.0, 0.0
        grad_norm = float(progress.get("grad_norm", math.nan)) if progress else math.nan
        return skip, (loss_sum, seen, seconds, grad_norm)

    def record_epoch(self, epoch: int, metrics: dict[str, float], monitor: str, mode: str) -> bool:
        """Add the epoch to the history; True when its ``monitor`` value is the best so far."""
        monitored = metrics[monitor]
        improved = self.best is None or (monitored < self.best if mode == "min" else monitored > self.best)
        if improved:
            self.best, self.best_epoch = monitored, epoch
        self.history.append({"epoch": epoch, "step": self.step, **metrics})
        return improved


class RunCheckpoints:
    """The checkpoints of a run writing to ``out``: :meth:`restore` loads the latest into the
    training objects, :meth:`save` writes them (on rank 0, when ``cfg.save_checkpoints``).
    ``generator``: a population member's own random stream (core/population.py), saved and restored
    where a run alone keeps the global one, so either can resume the other's checkpoint.

    With ``cfg.checkpoint_every`` above 1, an epoch that sets a new best but writes no checkpoint
    keeps a copy of its weights (:meth:`keep_best`), written as ``best.pt`` with the next
    checkpoint: ``best.pt`` then always holds the weights of the best epoch that ``last.pt``'s
    state records."""

    def __init__(self, out: Path | None, owner: str | None, cfg: TrainConfig, task: Task, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler, precision: Precision, is_main: bool,
                 generator: torch.Generator | None = None) -> None:
        self.out, self.owner, self.generator = out, owner, generator
        self.model, self.optimizer, self.scheduler, self.precision = model, optimizer, scheduler, precision
        self.is_main = is_main
        self.saving = out is not None and is_main and cfg.save_checkpoints
        self.every, self.last_epoch = cfg.checkpoint_every, cfg.epochs
        self._best: dict | None = None  # the best epoch's weights, not yet in best.pt (keep_best)
        # The same in every checkpoint of the run: serialised once, not at every epoch.
        self._config_json = json.dumps(cfg.to_dict()) if self.saving else ""
        self._task_json = json.dumps(task.describe()) if self.saving else ""

    def restore(self, world_size: int) -> RunState | None:
        """Load ``last.pt`` (or ``last.prev.pt``, see ``checkpoint.load_resume_state``) into the
        model, optimizer, scheduler, scaler and RNG, and return its RunState; None without one."""
        found = ckpt.load_resume_state(self.out, self.owner) if self.out is not None else None
        if self.out is not None and self.is_main:  # best.pt as last.pt records it, saving or not
            ckpt.settle_best(self.out, found[0]["best_epoch"] if found is not None else None)
        if found is None:
            return None
        state, _ = found
        self.model.load_state_dict(ckpt.strip_prefixes(state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        set_rng_state(state["rng"])
        if self.generator is not None:
            self.generator.set_state(_stream(state["rng"], self.generator.device))
        step_log = StepLog()
        step_log.load_state_dict(state.get("steps"))
        progress = state.get("progress")  # set when interrupted mid-epoch
        start_epoch = state["epoch"] + (0 if progress else 1)
        if progress and progress.get("world_size", 1) != world_size:
            progress = None  # another sharding: its micro-batch index means nothing here, so redo the epoch
        return RunState(start_epoch=start_epoch, step=state["step"], best=state["best"],
                        best_epoch=state["best_epoch"], history=json.loads(state["history_json"]),
                        step_log=step_log, progress=progress)

    def due(self, epoch: int) -> bool:
        """Whether the end of ``epoch`` writes a checkpoint: every ``checkpoint_every`` epochs, and the last."""
        return epoch % self.every == 0 or epoch >= self.last_epoch

    def keep_best(self, run: RunState) -> None:
        """The epoch just recorded set a new best and writes no checkpoint: keep a copy of its
        weights. Its ``best.pt`` holds them with the keys a reader of the best epoch looks for
        (``model``, ``epoch``, ``best``, ``best_epoch``, config and owner), not the training state
        that only ``last.pt`` needs."""
        if self.saving:
            weights = ckpt.strip_prefixes(ckpt.unwrap_model(self.model).state_dict())
            self._best = {"model": {k: v.detach().clone() for k, v in weights.items()}, "epoch": run.best_epoch,
                          "best": run.best, "best_epoch": run.best_epoch}

    def write_kept_best(self) -> None:
        """Write the weights :meth:`keep_best` kept, if any, as ``best.pt``, when the run ends
        without another checkpoint: it diverged (a stop between checkpoints, a prune included,
        writes one with them)."""
        kept = self._kept()
        if kept is not None and self.out is not None:  # kept only while saving, into a folder
            ckpt.save_checkpoint(kept, self.out / ckpt.BEST)

    def _kept(self) -> dict | None:
        """The kept best epoch as ``best.pt``'s content (once), or None."""
        kept, self._best = self._best, None
        if kept is None:
            return None
        return {**kept, "config_json": self._config_json, "task_json": self._task_json, "owner": self.owner}

    def save(self, run: RunState, epoch: int, progress: dict | None = None, best: bool = False) -> None:
        """Write ``last.pt`` after ``epoch`` (``progress``: interrupted inside it), and ``best.pt``
        too when ``best`` (or the weights :meth:`keep_best` kept): everything needed to continue
        bitwise-identically."""
        if not self.saving:
            return
        assert self.out is not None  # saving implies a folder
        state = {
            "model": ckpt.strip_prefixes(_own(ckpt.unwrap_model(self.model).state_dict())),
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(), "rng": self._rng_state(),
            "epoch": epoch, "step": run.step, "best": run.best, "best_epoch": run.best_epoch,
            "history_json": json.dumps(run.history), "progress": progress,
            "config_json": self._config_json, "task_json": self._task_json,
            "owner": self.owner, "steps": run.step_log.state_dict(),
        }
        kept = self._kept()  # this epoch's best supersedes a kept earlier one
        ckpt.save_last(state, self.out, best=state if best else kept)

    def _rng_state(self) -> dict:
        state = rng_state()
        if self.generator is not None:  # the member's stream stands where the global one would alone
            device = self.generator.device
            if device.type == "cpu":
                state["torch"] = self.generator.get_state()
            else:
                state["cuda"] = list(state["cuda"])
                state["cuda"][device.index or 0] = self.generator.get_state()
        return state


def _stream(rng: dict, device: torch.device) -> torch.Tensor:
    """The saved state of ``device``'s stream in a checkpoint's RNG states."""
    return rng["torch"] if device.type == "cpu" else rng["cuda"][device.index or 0]


def _own(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with each tensor holding only its own memory: a population member's weights
    are views of the members' stacked rows, and torch.save would write the whole storage."""
    return {k: v.clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size() else v
            for k, v in state.items()}
