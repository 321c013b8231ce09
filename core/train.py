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
from core.grad_checkpoint import checkpoint_blocks
from core.gradients import StepGradients
from core.io_utils import save_json_atomic
from core.metrics import ValidationMeter, check_loss_value, metric_problem
from core.optim import build_optimizer, build_scheduler, current_lr, optimizer_steps_per_epoch, param_groups
from core.peak_memory import PeakMemory
from core.precision import Precision
from core.profiling import StepProfiler, start_profiler
from core.reporting import Decision, NullReporter, Reporter
from core.results import Stop, TrainResult
from core.run_state import RunCheckpoints, RunState
from core.seeding import configure_determinism, seed_everything
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
    validate(cfg)
    ctx = init_from_env(cfg.distributed.backend, cfg.device)
    # Only rank 0 talks to the outside; the others follow its broadcast decisions.
    reporter = (reporter or NullReporter()) if ctx.is_main else NullReporter()
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
    # train.profile: torch.profiler over a few steps (rank 0); None when unset, so no step pays for it.
    profiler = start_profiler(cfg.profile, cfg.device, out, reporter) if ctx.is_main else None
    try:
        result = _train(task, cfg, reporter, out, resume, owner, ctx, profiler)
    except BaseException:
        shutdown(ctx)
        raise
    finally:
        if profiler is not None:
            profiler.close()  # also when the run fails: a sweep worker goes on to its next trial
    shutdown(ctx, completed=True)
    if ctx.is_main:
        stop_here(Fault.AFTER_TRAINING)  # tests: a kill after training, before the caller records anything
    return result


def _train(task: Task, cfg: TrainConfig, reporter: Reporter, out: Path | None, resume: bool,
           owner: str | None, ctx: DistContext, profiler: StepProfiler | None) -> TrainResult:
    # ---- set-up: the monitored metric must be the task's (checked before the model or data is built)
    problem = metric_problem(task, cfg.monitor, cfg.monitor_mode == "max", "train.monitor / train.monitor_mode")
    if problem:
        raise TaskError(problem)
    # Seed first, so model init and data order depend only on cfg.seed
    device = resolve_device(cfg.device, ctx)
    peak = PeakMemory(device)  # this run's own peak_mem_mb, not the worker process's (core/peak_memory.py)
    seed_everything(cfg.seed)
    configure_determinism(cfg.deterministic)
    precision = Precision(cfg.precision, device)
    model, backbone = _build_model(task, cfg, ctx, device)
    backbone_params = list(backbone.parameters()) if backbone is not None else []

    train_ds, val_ds = task.datasets()
    check_datasets(task, cfg, train_ds, val_ds)
    train_loader = make_train_loader(train_ds, cfg, device, ctx, task.collate_fn)
    val_loader = make_val_loader(val_ds, cfg, device, ctx, task.collate_fn)
    micro_batches = len(train_loader)  # per epoch, at most max_steps_per_epoch (a stream may end sooner)
    accum = cfg.grad_accum_steps
    optimizer = _build_optimizer(model, cfg, backbone, ctx.world_size)
    scheduler, sched_interval = build_scheduler(optimizer, cfg, optimizer_steps_per_epoch(micro_batches, accum))
    ddp_model, fwd_model = _wrap(model, cfg, ctx, device)
    criterion = task.make_loss(cfg)
    meter = ValidationMeter(task, device)  # val_loss and the task's metrics (val_<name>)
    grads = StepGradients(list(model.parameters()), device, distributed=ctx.enabled)

    # ---- resume: weights, optimizer, scheduler, scaler, RNG, counters, curves, mid-epoch progress
    checkpoints = RunCheckpoints(out, owner, cfg, task, model, optimizer, scheduler, precision, ctx.is_main)
    restored = checkpoints.restore(ctx.world_size) if resume else None
    run = restored or RunState()
    if restored is not None:
        # The process that reported these may have died before they were stored, and this
        # run may be tracked in a new place: hand them over before the first new step.
        reporter.resumed(epoch_reports(run.history), run.step_log.reports())
    if out is not None and ctx.is_main:
        _write_config(out, cfg, task, reporter)

    stop: Stop | None = None  # why the run ends early; None while it goes on
    diverged: dict | None = None  # the divergence record, when the run diverged
    # Each step's numbers are read now (lag 0) or one step later (lag 1): core/step_stats.py.
    steps = StepReader(read_lag(device, ctx.enabled), reporter, run.step_log, ctx, device,
                       check_grad=not precision.tolerates_nonfinite_grads)
    if profiler is not None:
        profiler.start()
    for epoch in range(run.start_epoch, cfg.epochs + 1):
        # ---- train one epoch
        for p in backbone_params:  # frozen for the first `freeze_backbone_epochs` epochs
            p.requires_grad_(epoch > cfg.freeze_backbone_epochs)
        grads.attach()
        model.train()
        skip, (loss_sum, seen, train_time, grad_norm) = run.take_progress(ctx.is_main)
        steps.start_epoch(epoch, run.step, loss_sum, seen, grad_norm)
        t0 = time.perf_counter()
        last_i = skip - 1  # the last micro-batch trained in this epoch
        # The order and augmentation of epoch k depend only on (seed, k); resuming mid-epoch, the
        # micro-batches trained before the interrupt are not fetched (a stream's are replayed).
        for i, (x, y) in train_loader.epoch(epoch, start=skip):
            last_i = i
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
                    loss = _forward(fwd_model, criterion, x, y, cfg.mixup_alpha)
                if i == group_start:
                    check_loss_value(task, loss)
                    grads.before_backward()
                precision.backward(loss if group_size == 1 else loss / group_size)
            steps.add(loss, y.shape[0])  # no .item(): read with the step
            if not final_micro:
                continue
            # ---- one optimizer step (after `group_size` micro-batches)
            precision.unscale_(optimizer)  # clip and measure true gradients, not scaled ones
            # Without clipping, only measure: clipping at infinity would still rescale every gradient by 1.0.
            stop = steps.before_update(grads.clip_(cfg.grad_clip) if cfg.grad_clip else grads.norm())
            if stop is None:  # the step read before the weights change was fine
                precision.step(optimizer)
                grads.after_step()
                if sched_interval == "step":
                    scheduler.step()
                run.step += 1
                stop = steps.after_update(current_lr(optimizer))
                if profiler is not None and not profiler.step():
                    profiler = None  # its schedule is done: the rest of the run pays nothing
            if stop is not None:
                break
        stop = steps.finish_epoch() or stop  # lag 1: the epoch's last step is read only now
        train_time += time.perf_counter() - t0
        if stop is not None and stop.status == "diverged":
            if ctx.is_main:  # diverged.json: what a practitioner needs to find why
                stop, diverged = _record_divergence(stop, steps, last_i, (x, y), model, criterion, cfg,
                                                    optimizer, precision, out, reporter)
            break  # no checkpoint: the weights in memory may be spoiled
        sums = ctx.all_reduce_sum([steps.loss_sum, steps.seen], device)
        if stop is not None:  # interrupted mid-epoch: a resumed run continues at the next micro-batch
            checkpoints.save(run, epoch, progress={"next_batch": last_i + 1, "world_size": ctx.world_size,
                                                   "sums": (*sums, train_time), "grad_norm": steps.grad_norm})
            break

        # ---- validate
        val = _evaluate(fwd_model, val_loader, criterion, meter, device, precision, ctx)
        metrics = _epoch_metrics(sums, train_time, val, steps.grad_norm, optimizer, precision, peak)
        improved = run.record_epoch(epoch, metrics, cfg.monitor, cfg.monitor_mode)

        # ---- schedule, checkpoint, then report (a kill after the report still finds the checkpoint)
        if sched_interval == "epoch":
            scheduler.step()
        elif sched_interval == "plateau":
            assert isinstance(scheduler, lr_scheduler.ReduceLROnPlateau)  # build_scheduler pairs them
            scheduler.step(metrics[cfg.monitor])
        checkpoints.save(run, epoch, best=improved)
        decision = ctx.agree(reporter.report_epoch(epoch, run.step, metrics), device)
        if decision is Decision.PRUNE:
            stop = Stop("pruned", f"pruned after epoch {epoch} ({cfg.monitor}={metrics[cfg.monitor]:.6g})")
            break
        if decision is Decision.INTERRUPT:
            stop = Stop("interrupted", f"interrupted after epoch {epoch}; checkpoint saved")
            break

    # ---- end of run: the result, then (completed runs) evaluation and ONNX export of the best weights
    result = _result(stop, run, cfg.batch_size * ctx.world_size * accum, precision.skipped_steps)
    result.diverged = diverged
    if out is not None and ctx.is_main:
        result.checkpoint_last = out / ckpt.LAST if (out / ckpt.LAST).exists() else None
        result.checkpoint_best = out / ckpt.BEST if (out / ckpt.BEST).exists() else None
        if result.status == "completed":
            finalize_run(task, cfg, model, val_ds, device, out, reporter, result)
    return result


def _build_model(task: Task, cfg: TrainConfig, ctx: DistContext,
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


def _evaluate(model: nn.Module, loader, criterion, meter: ValidationMeter, device: torch.device,
              precision: Precision, ctx: DistContext) -> dict[str, float]:
    """``val_loss`` (the task's loss, averaged over samples) and the task's metrics on ``loader``."""
    model.eval()
    meter.reset()
    with torch.inference_mode(), precision.autocast():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            output = model(x)
            meter.update(output, y, criterion(output.float(), y))
    return meter.compute(lambda values: ctx.all_reduce_sum(values, device))


def _write_config(out: Path, cfg: TrainConfig, task: Task, reporter: Reporter) -> None:
    """``out/config.json``: what this run trains, logged as an artifact."""
    path = out / "config.json"
    save_json_atomic({"train": cfg.to_dict(), "task": task.describe()}, path)
    reporter.log_artifact(path, "config")
