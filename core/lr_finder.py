"""LR range test (Smith 2015) with fastai's suggestion rules, on a fresh model.

It builds its own model and optimizer from the task and config, so nothing of the
caller's is touched (no hidden state to patch and restore). The learning rate ramps
exponentially from ``start_lr`` to ``end_lr`` over at most ``num_steps`` optimizer
steps (and at most ``max_epochs`` of data); the loss is smoothed with a bias-corrected
exponential moving average; the test stops early once the smoothed loss exceeds
``diverge_factor`` times the best one seen. The result is plain data for the sweeps
layer to log and the dashboards to draw.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from core.config import TrainConfig
from core.data import TrainBatches, check_datasets, make_train_loader
from core.distributed import DistContext
from core.in_memory import InMemoryBatches
from core.optim import build_optimizer, param_groups
from core.precision import Precision
from core.seeding import seed_everything
from core.tasks.base import Task
from core.train import resolve_device

Rule = Literal["steepest", "valley", "minimum"]


@dataclass
class LRFinderResult:
    lrs: list[float]
    losses: list[float]  # raw per-step training loss
    smoothed: list[float]  # bias-corrected EMA of the loss
    suggestion: float  # by `rule`
    rule: str
    suggestions: dict[str, float] = field(default_factory=dict)  # every rule's answer
    stopped_early: bool = False  # diverged before the end of the ramp
    steps: int = 0
    epochs_cost: float = 0.0  # steps as a fraction of one epoch of optimizer steps

    def to_dict(self) -> dict:
        return asdict(self)


def lr_range_test(task: Task, cfg: TrainConfig, start_lr: float = 1e-7, end_lr: float = 10.0,
                  num_steps: int = 100, max_epochs: float | None = 1.0, rule: Rule = "minimum",
                  smoothing: float = 0.05, diverge_factor: float = 4.0) -> LRFinderResult:
    if not 0 < start_lr < end_lr:
        raise ValueError(f"lr_finder: need 0 < start_lr < end_lr, got {start_lr} and {end_lr}")
    device = resolve_device(cfg.device, DistContext())
    seed_everything(cfg.seed)
    model: nn.Module = task.build_model().to(device)
    train_ds, _ = task.datasets()
    check_datasets(task, cfg, train_ds, None)
    loader = make_train_loader(train_ds, cfg, device, DistContext(), task.collate_fn)
    steps_per_epoch = max(1, math.ceil(len(loader) / cfg.grad_accum_steps))
    if max_epochs is not None:
        num_steps = min(num_steps, max(2, int(max_epochs * steps_per_epoch)))

    optimizer = build_optimizer(param_groups(model, cfg, task.backbone(model)), cfg)
    base = [g["lr"] for g in optimizer.param_groups]
    for g, b in zip(optimizer.param_groups, base, strict=True):
        g["lr"] = start_lr * b / cfg.lr  # keep the groups' ratios (backbone multiplier)
    ratio = end_lr / start_lr
    ramp = LambdaLR(optimizer, lambda i: ratio ** (i / max(num_steps - 1, 1)))
    precision = Precision(cfg.precision, device)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    lrs, losses, smoothed = [], [], []
    avg, best, stopped = 0.0, math.inf, False
    model.train()
    batches = _cycle(loader)
    for step in range(num_steps):
        lr = optimizer.param_groups[-1]["lr"]
        loss_value = 0.0
        for _ in range(cfg.grad_accum_steps):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            with precision.autocast():
                loss = criterion(model(x), y)
            precision.backward(loss / cfg.grad_accum_steps)
            loss_value += loss.item() / cfg.grad_accum_steps
        if cfg.grad_clip:
            precision.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        ramp.step()
        if not math.isfinite(loss_value):
            stopped = True
            break
        avg = (1 - smoothing) * avg + smoothing * loss_value
        smooth = avg / (1 - (1 - smoothing) ** (step + 1))  # bias correction for the first steps
        lrs.append(lr)
        losses.append(loss_value)
        smoothed.append(smooth)
        best = min(best, smooth)
        if smooth > diverge_factor * best and step > 0:
            stopped = True
            break

    suggestions = suggest_all(lrs, smoothed)
    return LRFinderResult(lrs=lrs, losses=losses, smoothed=smoothed, suggestion=suggestions[rule], rule=rule,
                          suggestions=suggestions, stopped_early=stopped, steps=len(lrs),
                          epochs_cost=len(lrs) / steps_per_epoch)


def _cycle(loader: TrainBatches | InMemoryBatches):
    epoch = 0
    while True:
        for _, batch in loader.epoch(epoch):
            yield batch
        epoch += 1


def suggest_all(lrs: list[float], smoothed: list[float]) -> dict[str, float]:
    if len(lrs) < 8:
        raise ValueError(f"lr_finder: only {len(lrs)} usable steps; raise num_steps or lower start_lr")
    return {"steepest": suggest_steepest(lrs, smoothed), "valley": suggest_valley(lrs, smoothed),
            "minimum": suggest_minimum(lrs, smoothed)}


def suggest_steepest(lrs: list[float], smoothed: list[float]) -> float:
    """The learning rate where the smoothed loss falls fastest against log(lr).

    The first ``skip_begin`` points are skipped (as Lightning does): the bias-corrected
    EMA is least reliable there and those rates are far too small to matter."""
    skip_begin = _skip_begin(len(lrs))
    log_lrs = torch.tensor(lrs[skip_begin:]).log()
    loss = torch.tensor(smoothed[skip_begin:])
    slope = (loss[2:] - loss[:-2]) / (log_lrs[2:] - log_lrs[:-2])  # central differences
    return float(lrs[skip_begin + int(slope.argmin()) + 1])


def _skip_begin(n: int) -> int:
    return min(10, n // 4)


def suggest_minimum(lrs: list[float], smoothed: list[float]) -> float:
    """fastai's ``minimum`` rule (Smith's advice for one-cycle peaks): a tenth of the learning
    rate at which the smoothed loss is lowest. A minimum of a smoothed curve moves little with
    noise; a slope (``steepest``) is a difference of noisy points and, on a short ramp of a few
    steps per decade, can jump by a decade between seeds."""
    start = _skip_begin(len(lrs))  # the bias-corrected EMA is least reliable at the start
    return float(lrs[min(range(start, len(smoothed)), key=smoothed.__getitem__)]) / 10


def suggest_valley(lrs: list[float], smoothed: list[float]) -> float:
    """fastai's valley rule: take the longest stretch over which the loss keeps
    decreasing, and suggest the point about halfway into it (robust to noisy minima)."""
    n = len(smoothed)
    run = [1] * n  # length of the longest decreasing subsequence ending at i
    end = 0
    for i in range(1, n):
        for j in range(i):
            if smoothed[i] < smoothed[j] and run[i] < run[j] + 1:
                run[i] = run[j] + 1
        if run[i] > run[end]:
            end = i
    start = end - run[end] + 1
    third = (end - start) / 3
    return float(lrs[start + int(third) + int(third / 2)])
