"""What the training loop keeps for each run it trains: a plain run is one member, a population
(core/population.py) several, each with its own optimizer, schedule, checkpoints and reporter,
and the batches each member's data order gives it."""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.config import TrainConfig
from core.distributed import DistContext
from core.grad_checkpoint import checkpoint_blocks
from core.metrics import ValidationMeter
from core.population import MemberRun
from core.reporting import Reporter
from core.results import Stop
from core.run_state import RunCheckpoints, RunState
from core.seeding import member_generator, seed_everything
from core.step_stats import StepReader
from core.tasks.base import Task


@dataclass
class Member:
    """One run inside the loop: its objects (built as a run alone builds them) and where it stands."""

    lane: int  # its place in the population (0 for a plain run)
    cfg: TrainConfig
    reporter: Reporter
    out: Path | None
    model: nn.Module  # its own model (in a population, a view of its row of the stacked weights)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    interval: str  # when its scheduler steps: "step", "epoch" or "plateau"
    checkpoints: RunCheckpoints
    run: RunState
    steps: StepReader
    meter: ValidationMeter
    stop: Stop | None = None  # why it ended early; None while it goes on
    diverged: dict | None = None  # the divergence record, when it diverged
    skip: int = 0  # the first micro-batch of this epoch it trains (a run resumed mid-epoch skips some)
    last_i: int = -1  # the last micro-batch it trained in this epoch
    train_time: float = 0.0
    sums: list[float] = field(default_factory=list)  # the epoch's (loss, seen), summed over ranks
    batch: tuple | None = None  # the micro-batch it stopped at (core/forensics.py replays it)
    improved: bool = False  # its last epoch set a new best of the monitored metric


class CheckpointWriter:
    """Each member's checkpoint after an epoch (``best.pt`` too where it improved). A population's
    are written in threads: each file is fsynced, and a member's write waits on the disk, not on
    Python, so K members' writes overlap (16 small checkpoints in a third of the time one after
    another, on this project's 2-core VM). The threads are started once for the run: starting 16
    every epoch made the training thread wait for each to be scheduled, on a busy machine longer
    than the writes."""

    def __init__(self, n_members: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=min(n_members, 16), thread_name_prefix="checkpoints") \
            if n_members > 1 else None
        if self._pool is not None:  # the run's end (or its failure) lets the threads go
            weakref.finalize(self, self._pool.shutdown, wait=False)

    def save(self, members: list[Member], epoch: int) -> None:
        if self._pool is None or len(members) <= 1:
            for m in members:
                m.checkpoints.save(m.run, epoch, best=m.improved)
            return
        list(self._pool.map(lambda m: m.checkpoints.save(m.run, epoch, best=m.improved), members))


class MemberBatches:
    """The training batches of every member, epoch by epoch. Members with the same seed share one
    data order and one batch; with several seeds each order is read and its batches are stacked
    (``[orders, batch, ...]``), and :meth:`for_lanes` gives the live members theirs."""

    def __init__(self, loaders: dict[int, Any], seeds: list[int]) -> None:
        self.loaders, self.seeds = loaders, seeds
        self.orders = list(loaders)  # the distinct seeds, in the order the stacked batches hold them
        self.per_member = len(loaders) > 1

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[int, Any]]:
        """``(i, (x, y))`` from micro-batch ``start``, as a run's ``TrainBatches.epoch`` yields them."""
        if not self.per_member:
            return self.loaders[self.orders[0]].epoch(epoch, start)
        return self._stacked(epoch, start)

    def _stacked(self, epoch: int, start: int) -> Iterator[tuple[int, Any]]:
        passes = [loader.epoch(epoch, start) for loader in self.loaders.values()]
        for parts in zip(*passes, strict=False):
            i = parts[0][0]
            yield i, (torch.stack([x for _, (x, _) in parts]), torch.stack([y for _, (_, y) in parts]))

    def size(self, y: torch.Tensor) -> int:
        """The micro-batch's samples (per member)."""
        return y.shape[1] if self.per_member else y.shape[0]

    def for_lanes(self, x: torch.Tensor, y: torch.Tensor, lanes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of each of ``lanes``, stacked in their order (one shared batch stays as it is)."""
        if not self.per_member:
            return x, y
        index = torch.tensor([self.orders.index(self.seeds[k]) for k in lanes], device=x.device)
        return x.index_select(0, index), y.index_select(0, index)

    def member_batch(self, batch: tuple, lane: int) -> tuple:
        """Member ``lane``'s own ``(x, y)`` of a batch."""
        if not self.per_member or not batch:
            return batch
        order = self.orders.index(self.seeds[lane])
        return batch[0][order], batch[1][order]


def build_model(task: Task, cfg: TrainConfig, ctx: DistContext,
                 device: torch.device) -> tuple[nn.Module, nn.Module | None]:
    """The task's model on ``device`` (BatchNorm synchronised across DDP ranks when asked), and its
    pretrained backbone or None."""
    model = task.build_model()
    if task.checkpoint_blocks:  # gradient checkpointing of the task's named blocks, set once here
        checkpoint_blocks(model, task.checkpoint_blocks, task.name)
    if ctx.enabled and cfg.distributed.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    return model, task.backbone(model)


def build_members(task: Task, runs: list[MemberRun], ctx: DistContext, device: torch.device) -> tuple:
    """Each member's model built after seeding with its own seed, as its run alone builds it, and the
    task's datasets (built once, after the first member's model). A population's members draw their
    dropout masks from generators that continue each seed's stream from where the run alone would
    start training; a plain run (None) keeps the global one."""
    models: list[nn.Module] = []
    generators: list[torch.Generator] = []
    after: dict[int, torch.Tensor] = {}  # each seed's stream where its run alone starts training
    backbone, data = None, None
    for run in runs:
        seed_everything(run.cfg.seed)
        model, backbone = build_model(task, run.cfg, ctx, device)
        models.append(model)
        if data is None:
            data = task.datasets()
        elif run.cfg.seed not in after:  # this seed's stream moves as its run's call would move it
            task.datasets()
        if len(runs) > 1:
            after.setdefault(run.cfg.seed, member_generator(device).get_state())
            generators.append(member_generator(device, after[run.cfg.seed]))
    return models, backbone, generators, data
