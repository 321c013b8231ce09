"""DataLoaders built from the config: seeded, resumable, DDP-aware."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from core.config import TrainConfig
from core.distributed import DistContext
from core.seeding import worker_init_fn
from core.tasks.base import Task, TaskError


def resolve_num_workers(setting: int) -> int:
    """-1 means about half the CPU threads this process may use (the sweep pool sets
    that share per worker, so parallel trials do not oversubscribe the cores)."""
    if setting >= 0:
        return setting
    return max(0, torch.get_num_threads() // 2)


def check_not_empty(task: Task, train_ds: Dataset, val_ds: Dataset) -> None:
    """Refuse empty datasets before any step: the loop would otherwise train on nothing and
    report a validation accuracy of 0.0 as if it had been measured."""
    for which, ds in (("train", train_ds), ("validation", val_ds)):
        try:
            n = len(ds)  # type: ignore[arg-type]
        except TypeError:  # no length (an iterable dataset): the samplers below would refuse it anyway
            continue
        if n == 0:
            raise TaskError(f"task {task.name!r} ({task.describe()}) returned an empty {which} dataset (0 samples) "
                            f"from datasets(); check its data source")


def make_train_loader(ds: Dataset, cfg: TrainConfig, device: torch.device, ctx: DistContext) -> DataLoader:
    """Shuffling comes from a DistributedSampler seeded with ``cfg.seed`` and re-keyed by
    ``set_epoch`` each epoch, in single-process runs too: the order of epoch k depends only
    on (seed, k), which makes resume exact and keeps one code path for DDP."""
    sampler: DistributedSampler[int] = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=cfg.seed, drop_last=False)
    return _loader(ds, cfg, device, sampler)


def make_val_loader(ds: Dataset, cfg: TrainConfig, device: torch.device, ctx: DistContext) -> DataLoader:
    """Each rank validates a strided shard with no padding, so summed metrics count every sample once."""
    if ctx.enabled:
        ds = Subset(ds, range(ctx.rank, len(ds), ctx.world_size))  # type: ignore[arg-type]  # map-style: has a len
    return _loader(ds, cfg, device, None)


def _loader(ds: Dataset, cfg: TrainConfig, device: torch.device, sampler) -> DataLoader:
    workers = resolve_num_workers(cfg.num_workers)
    extra: dict[str, Any] = {}
    if workers > 0:
        # Workers stay alive across epochs; their seeds come from the generator below.
        extra = {"persistent_workers": True, "prefetch_factor": cfg.prefetch_factor,
                 "worker_init_fn": worker_init_fn}
    return DataLoader(
        ds, batch_size=cfg.batch_size, sampler=sampler, shuffle=False, num_workers=workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",  # page-locked memory only helps host->GPU copies
        generator=torch.Generator().manual_seed(cfg.seed), drop_last=False, **extra,
    )
