"""The one training loop. Every path runs it: a sweep trial, a rerun, a DDP rank, a benchmark.

Read it top to bottom: set-up, resume, the epoch loop (micro-batches, optimizer steps,
validation, checkpoint, report), then the end-of-run evaluation and ONNX export.
It talks outward only through the Reporter passed in.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.optim import lr_scheduler

from core import checkpoint as ckpt
from core.config import TrainConfig, validate
from core.curves import epoch_reports
from core.data import check_datasets, make_train_loader, make_val_loader
from core.distributed import DistContext, init_from_env, lr_scale_factor, shutdown
from core.faults import Fault, stop_here
from core.finalize import finalize_run
from core.forensics import record_divergence
from core.io_utils import save_json_atomic
from core.members import CheckpointWriter, Member, MemberBatches, build_members
from core.metrics import ValidationMeter, check_loss_value, metric_problem
from core.optim import build_optimizer, build_scheduler, current_lr, optimizer_steps_per_epoch, param_groups
from core.pack_rules import config_problem
from core.peak_memory import PeakMemory
from core.population import LayoutHook, MemberRun, PackError, Population, stack_members
from core.precision import Precision
from core.profiling import StepProfiler, start_profiler
from core.reporting import Decision, NullReporter, Reporter
from core.results import Stop, TrainResult
from core.run_state import RunCheckpoints, RunState
from core.seeding import configure_determinism
from core.step_stats import StepReader, read_lag
from core.tasks.base import Task, TaskError


def resolve_device(setting: str, ctx: DistContext) -> torch.device:
    """``auto`` picks CUDA when present, else CPU. DDP ranks take their local GPU."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ctx.local_rank if ctx.enabled else torch.cuda.current_device())
    return device


def train(task: Task, cfg: TrainConfig, reporter: Reporter | None = None,
          out_dir: str | Path | None = None, resume: bool = False, owner: str | None = None) -> TrainResult:
    """Train ``task`` with ``cfg``; checkpoints and exports go to ``out_dir``.

    ``resume=True`` continues from ``out_dir/last.pt`` (or ``last.prev.pt`` when the
    latest file is corrupt) when one exists; N epochs straight and N/2 + resume + N/2
    give bitwise-identical weights on CPU, and the reporter hears what the checkpoint
    recorded first (``Reporter.resumed``), so together it gets the straight run's curves.
    ``owner`` names the run in its checkpoints; resuming from a checkpoint of another owner
    (or of none, when one is given) raises CheckpointError before anything is trained.
    """
    return train_population(task, [MemberRun(cfg, reporter, out_dir, owner)], resume)[0]


def train_population(task: Task, runs: list[MemberRun], resume: bool = False,
                     on_layout: LayoutHook | None = None) -> list[TrainResult]:
    """Train several runs of ``task`` whose models have the same shapes as one population
    (core/population.py), each as :func:`train` would alone (its own reporter, folder, checkpoints,
    pruning and result); one run is a plain run. A population the loop cannot hold raises :class:`PackError`,
    saying why, before any step; ``on_layout`` hears how one it holds runs (``Population.layout``) before it."""
    cfgs = [run.cfg for run in runs]
    for cfg in cfgs:
        validate(cfg)
    problem = config_problem(cfgs) if len(runs) > 1 else None
    if problem:
        raise PackError(problem)
    cfg = cfgs[0]
    ctx = init_from_env(cfg.distributed.backend, cfg.device)
    # Only rank 0 talks to the outside; the others follow its broadcast decisions.
    reporters = [(run.reporter or NullReporter()) if ctx.is_main else NullReporter() for run in runs]
    outs = [Path(run.out_dir) if run.out_dir is not None else None for run in runs]
    for out in outs:
        if out is not None and ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
    # train.profile: torch.profiler over a few steps (rank 0); None when unset, so no step pays for it.
    profiler = start_profiler(cfg.profile, cfg.device, outs[0], reporters[0]) if ctx.is_main else None
    try:
        results = _train(task, runs, reporters, outs, resume, ctx, profiler, on_layout)
    except BaseException:
        shutdown(ctx)
        raise
    finally:
        if profiler is not None:
            profiler.close()  # also when the run fails: a sweep worker goes on to its next trial
    shutdown(ctx, completed=True)
    if ctx.is_main:
        stop_here(Fault.AFTER_TRAINING)  # tests: a kill after training, before the caller records anything
    return results


def _train(task: Task, runs: list[MemberRun], reporters: list[Reporter], outs: list[Path | None], resume: bool,
           ctx: DistContext, profiler: StepProfiler | None, on_layout: LayoutHook | None) -> list[TrainResult]:
    # ---- set-up: the monitored metric must be the task's (checked before the model or data is built)
    cfg = runs[0].cfg  # what every member shares (pack_rules.MEMBER_FIELDS may differ)
    problem = metric_problem(task, cfg.monitor, cfg.monitor_mode == "max", "train.monitor / train.monitor_mode")
    if problem:
        raise TaskError(problem)
    device = resolve_device(cfg.device, ctx)
    peak = PeakMemory(device)  # this run's own peak_mem_mb, not the worker process's (core/peak_memory.py)
    configure_determinism(cfg.deterministic)
    precision = Precision(cfg.precision, device)
    # Each member seeded first, so its model init and data order depend only on its seed
    models, backbone, generators, (train_ds, val_ds) = build_members(task, runs, ctx, device)
    backbone_params = list(backbone.parameters()) if backbone is not None else []

    check_datasets(task, cfg, train_ds, val_ds)
    loaders = {s: make_train_loader(train_ds, r.cfg, device, ctx, task.collate_fn)
               for s, r in {r.cfg.seed: r for r in runs}.items()}  # one per data order (seed)
    val_loader = make_val_loader(val_ds, cfg, device, ctx, task.collate_fn)
    micro_batches = len(loaders[cfg.seed])  # per epoch, at most max_steps_per_epoch (a stream may end sooner)
    accum = cfg.grad_accum_steps
    criterion = task.make_loss(cfg)
    model, grads = stack_members(models, generators, backbone, task, loaders[cfg.seed], criterion, device,
                                 ctx.enabled, on_layout)
    batches = MemberBatches(loaders, [r.cfg.seed for r in runs])
    optimizers = [_build_optimizer(m, run.cfg, backbone, ctx.world_size) for m, run in zip(models, runs, strict=True)]
    ddp_model, fwd_model = _wrap(model, cfg, ctx, device)  # after the optimizers: the same parameters
    members = []
    for k, (run, reporter, out, member_model, optimizer) in enumerate(zip(runs, reporters, outs, models, optimizers,
                                                                          strict=True)):
        scheduler, interval = build_scheduler(optimizer, run.cfg, optimizer_steps_per_epoch(micro_batches, accum))
        checkpoints = RunCheckpoints(out, run.owner, run.cfg, task, member_model, optimizer, scheduler, precision,
                                     ctx.is_main, generators[k] if len(runs) > 1 else None)
        # ---- resume: weights, optimizer, scheduler, scaler, RNG, counters, curves, mid-epoch progress
        restored = checkpoints.restore(ctx.world_size) if resume else None
        state = restored or RunState()
        if restored is not None:
            # The process that reported these may have died before they were stored, and this
            # run may be tracked in a new place: hand them over before the first new step.
            reporter.resumed(epoch_reports(state.history), state.step_log.reports())
        if out is not None and ctx.is_main:
            _write_config(out, run.cfg, task, reporter)
        # Each step's numbers are read now (lag 0) or one step later (lag 1): core/step_stats.py.
        steps = StepReader(read_lag(device, ctx.enabled), reporter, state.step_log, ctx, device,
                           check_grad=not precision.tolerates_nonfinite_grads)
        members.append(Member(k, run.cfg, reporter, out, member_model, optimizer, scheduler, interval, checkpoints,
                              state, steps, ValidationMeter(task, device)))

    writer = CheckpointWriter(len(members))
    if profiler is not None:
        profiler.start()
    batch: tuple = ()
    for epoch in range(min(m.run.start_epoch for m in members), cfg.epochs + 1):
        # ---- train one epoch (each member from where it stands: all at once, unless resumed apart)
        training = [m for m in members if m.stop is None and m.run.start_epoch <= epoch]
        if all(m.stop is not None for m in members):
            break
        for p in backbone_params:  # frozen for the first `freeze_backbone_epochs` epochs
            p.requires_grad_(epoch > cfg.freeze_backbone_epochs)
        grads.attach()
        model.train()
        for m in training:
            m.skip, (loss_sum, seen, m.train_time, grad_norm) = m.run.take_progress(ctx.is_main)
            m.steps.start_epoch(epoch, m.run.step, loss_sum, seen, grad_norm)
            m.last_i = m.skip - 1  # the last micro-batch trained in this epoch
        t0 = time.perf_counter()
        # The order and augmentation of epoch k depend only on (seed, k); resuming mid-epoch, the
        # micro-batches trained before the interrupt are not fetched (a stream's are replayed).
        for i, (x, y) in batches.epoch(epoch, start=min((m.skip for m in training), default=0)):
            live = [m for m in training if m.stop is None and i >= m.skip]
            if not live:  # resumed apart: the members ahead wait for the batch they stopped at
                continue
            batch = (x, y)
            group_start = (i // accum) * accum
            group_size = min(accum, micro_batches - group_start)  # the epoch's remainder group is smaller
            final_micro = i - group_start == group_size - 1
            if device.type != "cpu":  # on CPU .to() returns the same tensors, at a dispatch each
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP: skip the gradient all-reduce on non-final accumulation micro-steps.
            sync = (cast(nn.parallel.DistributedDataParallel, ddp_model).no_sync() if ctx.enabled and not final_micro
                    else contextlib.nullcontext())
            with sync:
                with precision.autocast():
                    losses, total = _losses(fwd_model, criterion, batches, x, y, cfg.mixup_alpha, live)
                if i == group_start:
                    check_loss_value(task, losses[0])
                    grads.before_backward()
                precision.backward(total if group_size == 1 else total / group_size)
            for m, loss in zip(live, losses, strict=True):
                m.last_i = i
                m.steps.add(loss, batches.size(y))  # no .item(): read with the step
            if not final_micro:
                continue
            # ---- one optimizer step of each member (after `group_size` micro-batches)
            for m in live:
                precision.unscale_(m.optimizer)  # clip and measure true gradients, not scaled ones
            # Without clipping, only measure: clipping at infinity would still rescale every gradient by 1.0.
            norms = grads.measure([m.cfg.grad_clip for m in live], [m.lane for m in live])
            stepped = False
            for m, norm in zip(live, norms, strict=True):
                m.stop = m.steps.before_update(norm)
                if m.stop is None:  # the step read before the weights change was fine
                    precision.step(m.optimizer)
                    stepped = True
                    if m.interval == "step":
                        m.scheduler.step()
                    m.run.step += 1
                    m.stop = m.steps.after_update(current_lr(m.optimizer))
                if m.stop is not None:
                    m.batch = batches.member_batch((x, y), m.lane)
            if stepped:
                grads.after_step()
                if profiler is not None and not profiler.step():
                    profiler = None  # its schedule is done: the rest of the run pays nothing
            if all(m.stop is not None for m in training):
                break
        elapsed = time.perf_counter() - t0
        validating = []
        for m in training:
            m.stop = m.steps.finish_epoch() or m.stop  # lag 1: the epoch's last step is read only now
            m.train_time += elapsed
            if m.stop is not None and m.stop.status == "diverged":
                if ctx.is_main:  # diverged.json: what a practitioner needs to find why
                    m.stop, m.diverged = _record_divergence(
                        m.stop, m.steps, m.last_i, m.batch or batches.member_batch(batch, m.lane), m.model,
                        criterion, m.cfg, m.optimizer, precision, m.out, m.reporter)
                continue  # no checkpoint: the weights in memory may be spoiled
            m.sums = ctx.all_reduce_sum([m.steps.loss_sum, m.steps.seen], device)
            if m.stop is not None:  # interrupted mid-epoch: a resumed run continues at the next micro-batch
                m.checkpoints.save(m.run, epoch, progress={
                    "next_batch": m.last_i + 1, "world_size": ctx.world_size, "sums": (*m.sums, m.train_time),
                    "grad_norm": m.steps.grad_norm})
                continue
            validating.append(m)

        # ---- validate
        vals = _evaluate(fwd_model, val_loader, criterion, validating, device, precision, ctx)
        epoch_metrics = []
        for m, val in zip(validating, vals, strict=True):
            metrics = _epoch_metrics(m.sums, m.train_time, val, m.steps.grad_norm, m.optimizer, precision, peak)
            m.improved = m.run.record_epoch(epoch, metrics, cfg.monitor, cfg.monitor_mode)
            epoch_metrics.append(metrics)

            # ---- schedule, checkpoint, then report (a kill after the report still finds the checkpoint)
            if m.interval == "epoch":
                m.scheduler.step()
            elif m.interval == "plateau":
                assert isinstance(m.scheduler, lr_scheduler.ReduceLROnPlateau)  # build_scheduler pairs them
                m.scheduler.step(metrics[cfg.monitor])
        for m in validating:
            if m.improved and not m.checkpoints.due(epoch):
                m.checkpoints.keep_best(m.run)
        # A population's members at once, each to its own folder; train.checkpoint_every spaces them.
        writer.save([m for m in validating if m.checkpoints.due(epoch)], epoch)
        stopped_between = []  # between checkpoints: the stop writes one
        for m, metrics in zip(validating, epoch_metrics, strict=True):
            decision = ctx.agree(m.reporter.report_epoch(epoch, m.run.step, metrics), device)
            if decision is Decision.PRUNE:
                m.stop = Stop("pruned", f"pruned after epoch {epoch} ({cfg.monitor}={metrics[cfg.monitor]:.6g})")
            if decision is Decision.INTERRUPT:
                m.stop = Stop("interrupted", f"interrupted after epoch {epoch}; checkpoint saved")
            if m.stop is not None and not m.checkpoints.due(epoch):
                stopped_between.append(m)  # last.pt records the best that best.pt then holds
        writer.save(stopped_between, epoch)

    # ---- end of run: each result, then (completed runs) evaluation and ONNX export of the best weights
    results = []
    for m in members:
        result = _result(m.stop, m.run, cfg.batch_size * ctx.world_size * accum, precision.skipped_steps)
        result.diverged = m.diverged
        m.checkpoints.write_kept_best()  # diverged between checkpoints: best.pt as recorded
        out = m.out
        if out is not None and ctx.is_main:
            result.checkpoint_last = out / ckpt.LAST if (out / ckpt.LAST).exists() else None
            result.checkpoint_best = out / ckpt.BEST if (out / ckpt.BEST).exists() else None
            if result.status == "completed":
                member_model = model.release(m.lane) if isinstance(model, Population) else m.model
                finalize_run(task, m.cfg, member_model, val_ds, device, out, m.reporter, result)
        results.append(result)
    return results


def _build_optimizer(model: nn.Module, cfg: TrainConfig, backbone: nn.Module | None,
                     world_size: int) -> torch.optim.Optimizer:
    """The optimizer, its learning rates scaled for the DDP world size (``distributed.lr_scale_rule``)."""
    lr_scale = lr_scale_factor(cfg.distributed.lr_scale_rule, world_size)
    optimizer = build_optimizer(param_groups(model, cfg, backbone), cfg)
    if lr_scale != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= lr_scale
    return optimizer


def _wrap(model: nn.Module, cfg: TrainConfig, ctx: DistContext,
          device: torch.device) -> tuple[nn.Module, nn.Module]:
    """``(ddp_model, fwd_model)``: the module whose ``no_sync`` skips DDP's all-reduce, and the one
    the forward pass calls. DDP wraps after the optimizer is built (same parameters); compile
    wraps last."""
    ddp_model = model
    if ctx.enabled:
        ddp_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    # torch.compile of a module returns a module (OptimizedModule); its stub says any callable.
    fwd_model = cast(nn.Module, torch.compile(ddp_model)) if cfg.compile else ddp_model
    return ddp_model, fwd_model


def _record_divergence(stop: Stop, steps: StepReader, micro_batch: int, batch: tuple, model: nn.Module,
                       criterion, cfg: TrainConfig, optimizer: torch.optim.Optimizer, precision: Precision,
                       out: Path | None, reporter: Reporter) -> tuple[Stop, dict]:
    """diverged.json for the step that stopped the run (core/forensics.py); the plain model, not
    the DDP or compiled wrapper, replays it under ``train.detect_anomaly``."""
    bad = steps.diverged
    assert bad is not None  # a "diverged" stop comes from the step it read
    x, y = batch

    def replay() -> torch.Tensor:
        with precision.autocast():
            return _forward(model, criterion, x, y, cfg.mixup_alpha)

    return record_divergence(
        stop, step=bad.step, epoch=bad.epoch, micro_batch=micro_batch, batch=batch, losses=bad.loss_values,
        model=model, lr=current_lr(optimizer), late=steps.lag == 1, out=out,
        loss_fn=replay if cfg.detect_anomaly else None, reporter=reporter,
        amp_scale=precision.scaler.get_scale() if precision.scaler.is_enabled() else None)


def _epoch_metrics(train_sums: list[float], train_time: float, val: dict[str, float], grad_norm: float,
                   optimizer: torch.optim.Optimizer, precision: Precision,
                   peak: PeakMemory) -> dict[str, float]:
    """The epoch's report (``core.metrics``): ``train_sums`` (loss, seen) are summed over ranks,
    ``val`` is val_loss and the task's metrics; the peak memory is read after validation, which counts."""
    loss_sum, seen = train_sums
    return {
        "train_loss": loss_sum / max(seen, 1), **val, "lr": current_lr(optimizer), "grad_norm": grad_norm,
        "samples_per_s": seen / max(train_time, 1e-9), "epoch_time_s": train_time,
        "peak_mem_mb": peak.mb(), "skipped_steps": float(precision.skipped_steps),
    }


def _result(stop: Stop | None, run: RunState, global_batch_size: int, skipped_steps: int) -> TrainResult:
    """What ``train`` returns, before the checkpoints' paths and the end-of-run evaluation."""
    status, reason = stop or ("completed", "")
    return TrainResult(
        status=status, reason=reason, epochs_completed=len(run.history), steps_completed=run.step,
        metrics=run.last_metrics(), best_metric=run.best, best_epoch=run.best_epoch, history=run.history,
        global_batch_size=global_batch_size, skipped_steps=skipped_steps,
    )


def _forward(model: nn.Module, criterion, x: torch.Tensor, y: torch.Tensor, mixup_alpha: float) -> torch.Tensor:
    """The batch's training loss (the task's ``make_loss``)."""
    if mixup_alpha <= 0:
        return criterion(model(x), y)
    # Mixup: blend each sample with a shuffled partner; the loss blends both targets the same way.
    lam = float(torch.distributions.Beta(mixup_alpha, mixup_alpha).sample())
    perm = torch.randperm(x.shape[0], device=x.device)
    output = model(lam * x + (1 - lam) * x[perm])
    return lam * criterion(output, y) + (1 - lam) * criterion(output, y[perm])


def _losses(model: nn.Module, criterion, batches: MemberBatches, x: torch.Tensor, y: torch.Tensor,
            mixup_alpha: float, live: list[Member]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each live member's training loss on the micro-batch, and their sum (what backward takes:
    the members' weights are apart, so each gets its own loss's gradient)."""
    if not isinstance(model, Population):
        loss = _forward(model, criterion, x, y, mixup_alpha)
        return [loss], loss
    lanes = [m.lane for m in live]
    xs, ys = batches.for_lanes(x, y, lanes)
    losses = model.losses(criterion, model(xs, lanes, batches.per_member), ys, batches.per_member)
    return list(losses.unbind()), losses.sum()


def _evaluate(model: nn.Module, loader, criterion, members: list[Member], device: torch.device,
              precision: Precision, ctx: DistContext) -> list[dict[str, float]]:
    """Each member's ``val_loss`` (the task's loss, averaged over samples) and the task's metrics on
    ``loader``; a population's members are evaluated in one forward pass a batch."""
    if not members:
        return []
    model.eval()
    for m in members:
        m.meter.reset()
    lanes = [m.lane for m in members]
    with torch.inference_mode(), precision.autocast():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            outputs = model(x, lanes) if isinstance(model, Population) else [model(x)]
            for m, output in zip(members, outputs, strict=True):
                m.meter.update(output, y, criterion(output.float(), y))
    return [m.meter.compute(lambda values: ctx.all_reduce_sum(values, device)) for m in members]


def _write_config(out: Path, cfg: TrainConfig, task: Task, reporter: Reporter) -> None:
    """``out/config.json``: what this run trains, logged as an artifact."""
    path = out / "config.json"
    save_json_atomic({"train": cfg.to_dict(), "task": task.describe()}, path)
    reporter.log_artifact(path, "config")
