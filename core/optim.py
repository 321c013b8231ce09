"""Optimizers with parameter groups, and schedules from ``torch.optim.lr_scheduler``.

Step-based schedules (OneCycle, cosine with warmup) count *optimizer* steps, i.e.
after gradient accumulation: a run of E epochs with S optimizer steps per epoch
has E*S scheduler steps in total.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn
from torch.optim import lr_scheduler

from core.config import TrainConfig

Interval = Literal["step", "epoch", "plateau"]


def param_groups(model: nn.Module, cfg: TrainConfig, backbone: nn.Module | None) -> list[dict]:
    """One group for the head and, when the task names a pretrained backbone, one for it
    at ``lr * backbone_lr_mult``. Group order is stable (backbone first) for checkpoints."""
    if backbone is None:
        return [{"params": [p for p in model.parameters()], "lr": cfg.lr, "name": "all"}]
    backbone_ids = {id(p) for p in backbone.parameters()}
    bb = [p for p in model.parameters() if id(p) in backbone_ids]
    head = [p for p in model.parameters() if id(p) not in backbone_ids]
    return [
        {"params": bb, "lr": cfg.lr * cfg.backbone_lr_mult, "name": "backbone"},
        {"params": head, "lr": cfg.lr, "name": "head"},
    ]


def build_optimizer(groups: Iterable[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD, Adam or AdamW over ``groups``. On CPU, PyTorch's fused implementation where it has
    one for the parameters (floating point): one pass a step over each tensor's memory instead of
    one per operation (weight decay, momentum, update), which makes a CPU step of the optimizer
    much cheaper (benchmarks/README.md, trainer overhead); the weights differ from the
    default's only by rounding (fused multiply-adds). On GPUs, PyTorch's default (foreach) until
    the fused one is measured there (benchmarks/gpu_bench.py)."""
    groups = list(groups)
    if cfg.optimizer == "sgd":
        return _fused_if_supported(torch.optim.SGD, groups, lr=cfg.lr, momentum=cfg.momentum,
                                   nesterov=cfg.nesterov and cfg.momentum > 0, weight_decay=cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return _fused_if_supported(cls, groups, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)


def _fused_if_supported(cls, groups: list[dict], **kwargs) -> torch.optim.Optimizer:
    # The fused kernels take floating-point tensors only (torch checks at the first step, not here).
    fused = all(p.device.type == "cpu" and torch.is_floating_point(p) for g in groups for p in g["params"])
    return cls(groups, fused=True, **kwargs) if fused else cls(groups, **kwargs)


def optimizer_steps_per_epoch(micro_batches: int, accum: int) -> int:
    """A trailing remainder of micro-batches still makes one (smaller) optimizer step."""
    return math.ceil(micro_batches / accum)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                    steps_per_epoch: int) -> tuple[lr_scheduler.LRScheduler, Interval]:
    """Return the scheduler and when the loop must step it:
    "step" after every optimizer step, "epoch" after every epoch,
    "plateau" after validation with the monitored metric (a ReduceLROnPlateau, an LRScheduler too)."""
    total = cfg.epochs * steps_per_epoch
    max_lrs = [g["lr"] for g in optimizer.param_groups]
    if cfg.scheduler == "onecycle":
        return lr_scheduler.OneCycleLR(
            optimizer, max_lr=max_lrs, total_steps=total, pct_start=cfg.onecycle_pct_start,
            div_factor=cfg.onecycle_div_factor, final_div_factor=cfg.onecycle_final_div_factor,
            anneal_strategy="cos", cycle_momentum=cfg.optimizer == "sgd" and cfg.momentum > 0,
        ), "step"
    if cfg.scheduler == "cosine":
        warmup = min(int(round(cfg.warmup_epochs * steps_per_epoch)), total - 1)
        cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total - warmup, 1),
                                                eta_min=cfg.lr * cfg.cosine_min_lr_ratio)
        if warmup <= 0:
            return cosine, "step"
        # Linear warmup from lr/warmup to lr, then cosine down; SequentialLR hands over at `warmup`.
        ramp = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
        return lr_scheduler.SequentialLR(optimizer, [ramp, cosine], milestones=[warmup]), "step"
    if cfg.scheduler == "step":
        return lr_scheduler.StepLR(optimizer, step_size=cfg.step_size_epochs, gamma=cfg.step_gamma), "epoch"
    if cfg.scheduler == "plateau":
        return lr_scheduler.ReduceLROnPlateau(optimizer, mode=cfg.monitor_mode, factor=cfg.plateau_factor,
                                              patience=cfg.plateau_patience), "plateau"
    return lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0), "epoch"


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The head's learning rate (the last group), which is what ``lr`` in a spec means."""
    return float(optimizer.param_groups[-1]["lr"])
