"""The one training loop. Every path runs it: a sweep trial, a rerun, a DDP rank, a benchmark.

Read it top to bottom: set-up, resume, the epoch loop (micro-batches, optimizer steps,
validation, checkpoint, report), then the end-of-run evaluation and ONNX export.
It talks outward only through the Reporter passed in.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core import checkpoint as ckpt
from core.config import TrainConfig, validate
from core.curves import StepLog, epoch_reports
from core.data import check_not_empty, make_train_loader, make_val_loader
from core.distributed import DistContext, init_from_env, lr_scale_factor, shutdown
from core.faults import stop_here
from core.gradients import StepGradients
from core.optim import build_optimizer, build_scheduler, current_lr, optimizer_steps_per_epoch, param_groups
from core.precision import Precision
from core.reporting import Decision, NullReporter, Reporter
from core.results import TrainResult
from core.step_stats import PendingStep, read_lag
from core.seeding import configure_determinism, rng_state, seed_everything, set_rng_state
from core.tasks.base import Task

_DECISIONS = list(Decision)  # index <-> decision, for broadcasting under DDP


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
    try:
        result = _train(task, cfg, reporter, out, resume, owner, ctx)
    except BaseException:
        shutdown(ctx)
        raise
    shutdown(ctx, completed=True)
    if ctx.is_main:
        stop_here("after_training")  # tests: a kill after training, before the caller records anything
    return result


def _train(task: Task, cfg: TrainConfig, reporter: Reporter, out: Path | None, resume: bool,
           owner: str | None, ctx: DistContext) -> TrainResult:
    # ---- set-up: seed first, so model init and data order depend only on cfg.seed
    device = resolve_device(cfg.device, ctx)
    seed_everything(cfg.seed)
    configure_determinism(cfg.deterministic)
    precision = Precision(cfg.precision, device)

    model = task.build_model()
    if ctx.enabled and cfg.distributed.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    backbone = task.backbone(model)
    backbone_params = list(backbone.parameters()) if backbone is not None else []

    train_ds, val_ds = task.datasets()
    check_not_empty(task, train_ds, val_ds)
    train_loader = make_train_loader(train_ds, cfg, device, ctx)
    val_loader = make_val_loader(val_ds, cfg, device, ctx)
    micro_batches = len(train_loader)
    if cfg.max_steps_per_epoch is not None:
        micro_batches = min(micro_batches, cfg.max_steps_per_epoch)
    accum = cfg.grad_accum_steps
    steps_per_epoch = optimizer_steps_per_epoch(micro_batches, accum)

    lr_scale = lr_scale_factor(cfg.distributed.lr_scale_rule, ctx.world_size)
    optimizer = build_optimizer(param_groups(model, cfg, backbone), cfg)
    if lr_scale != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= lr_scale
    scheduler, sched_interval = build_scheduler(optimizer, cfg, steps_per_epoch)

    # DDP wraps after the optimizer is built (same parameters); compile wraps last.
    fwd_model: nn.Module = model
    if ctx.enabled:
        fwd_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp_model = fwd_model
    if cfg.compile:
        fwd_model = torch.compile(fwd_model)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    grads = StepGradients(list(model.parameters()), device, distributed=ctx.enabled)

    # ---- resume: weights, optimizer, scheduler, scaler, RNG, counters, curves, mid-epoch progress
    start_epoch, step, best, best_epoch, history, progress = 1, 0, None, None, [], None
    step_log = StepLog()  # every reported step, kept in checkpoints for the reporter of a resumed run
    if resume and out is not None:
        found = ckpt.load_resume_state(out, owner)
        if found is not None:
            state, _ = found
            model.load_state_dict(ckpt.strip_prefixes(state["model"]))
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            precision.load_state_dict(state["precision"])
            set_rng_state(state["rng"])
            step, best, best_epoch = state["step"], state["best"], state["best_epoch"]
            history = json.loads(state["history_json"])
            step_log.load_state_dict(state.get("steps"))
            progress = state.get("progress")  # set when interrupted mid-epoch
            start_epoch = state["epoch"] + (0 if progress else 1)
            if progress and progress.get("world_size", 1) != ctx.world_size:
                progress = None  # another sharding: its micro-batch index means nothing here, so redo the epoch
            # The process that reported these may have died before they were stored, and this
            # run may be tracked in a new place: hand them over before the first new step.
            reporter.resumed(epoch_reports(history), step_log.reports())

    if out is not None and ctx.is_main:
        config_path = out / "config.json"
        _write_json({"train": cfg.to_dict(), "task": task.describe()}, config_path)
        reporter.log_artifact(config_path, "config")

    def make_state(epoch: int, progress_: dict | None) -> dict:
        # The checkpoint holds everything needed to continue bitwise-identically.
        return {
            "model": ckpt.strip_prefixes(ckpt.unwrap_model(model).state_dict()),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "precision": precision.state_dict(), "rng": rng_state(),
            "epoch": epoch, "step": step, "best": best, "best_epoch": best_epoch,
            "history_json": json.dumps(history), "progress": progress_,
            "config_json": json.dumps(cfg.to_dict()), "task_json": json.dumps(task.describe()),
            "owner": owner, "steps": step_log.state_dict(),
        }

    status, reason = "completed", ""
    metrics = epoch_reports(history)[-1][2] if history else {}  # the last epoch's, also if none is left to run
    global_batch = cfg.batch_size * ctx.world_size * accum
    lag = read_lag(device, ctx.enabled)  # read each step's numbers now (0) or one step later (1)
    for epoch in range(start_epoch, cfg.epochs + 1):
        # ---- train one epoch
        train_loader.sampler.set_epoch(epoch)  # the shuffle of epoch k depends only on (seed, k)
        frozen = epoch <= cfg.freeze_backbone_epochs
        for p in backbone_params:
            p.requires_grad_(not frozen)
        grads.attach()
        model.train()
        skip = progress["next_batch"] if progress else 0
        loss_sum, correct, seen, train_time = (progress["sums"] if progress else (0.0, 0.0, 0.0, 0.0))
        if not ctx.is_main:  # the checkpoint's partial sums are already summed over ranks
            loss_sum, correct, seen = 0.0, 0.0, 0.0
        progress = None
        grad_norm = float("nan")
        # Each micro-batch's (prediction == label), summed once at the epoch's end: a sum every step
        # costs two more tensor ops a step, a visible share of a small CPU model's step (benchmarks/README.md).
        hits: list[torch.Tensor] = []
        pending: PendingStep | None = None  # a step whose numbers are queued but not yet read (lag 1)
        current = PendingStep(step + 1, epoch)

        def check(rec: PendingStep) -> str | None:
            """Read a step's numbers (the one host-device sync of a step) and say if it diverged."""
            rec.read()
            return rec.problem(check_loss=not ctx.enabled, check_grad=not precision.tolerates_nonfinite_grads)

        def report(rec: PendingStep) -> Decision:
            """Add a checked step to the epoch's sums and report it; every rank gets rank 0's decision."""
            nonlocal loss_sum, grad_norm
            group_loss = sum(v * n for v, n in zip(rec.loss_values, rec.sizes))
            group_n = sum(rec.sizes)
            loss_sum, grad_norm = loss_sum + group_loss, rec.norm_value
            if ctx.enabled:  # the step loss over the global batch, not rank 0's shard
                group_loss, group_n = ctx.all_reduce_sum([group_loss, group_n], device)
            step_metrics = {"train_loss": group_loss / group_n, "lr": rec.lr, "grad_norm": grad_norm}
            step_log.add(rec.step, step_metrics)
            decision = reporter.report_step(rec.step, step_metrics)
            return _agree(decision, ctx, device)

        t0 = time.perf_counter()
        last_i = -1
        for i, (x, y) in enumerate(train_loader):
            if i >= micro_batches:
                break
            if i < skip:
                continue  # resuming mid-epoch: these micro-batches were trained before the interrupt
            last_i = i
            group_start = (i // accum) * accum
            group_size = min(accum, micro_batches - group_start)  # the epoch's remainder group is smaller
            final_micro = i - group_start == group_size - 1
            if device.type != "cpu":  # on CPU .to() returns the same tensors, at a dispatch each
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP: skip the gradient all-reduce on non-final accumulation micro-steps.
            sync = ddp_model.no_sync() if ctx.enabled and not final_micro else contextlib.nullcontext()
            with sync:
                with precision.autocast():
                    logits, loss = _forward(fwd_model, criterion, x, y, cfg.mixup_alpha)
                if i == group_start:
                    grads.before_backward()
                precision.backward(loss if group_size == 1 else loss / group_size)
            # No .item() here: the numbers stay on the device until the step is read (core/step_stats.py).
            current.add(loss, y.shape[0])
            hits.append(logits.argmax(1) == y)
            seen += y.shape[0]
            if not final_micro:
                continue
            # ---- one optimizer step (after `group_size` micro-batches)
            precision.unscale_(optimizer)  # clip and measure true gradients, not scaled ones
            if cfg.grad_clip:
                current.grad_norm = grads.clip_(cfg.grad_clip)
            else:  # measure only: clipping at infinity would still rescale every gradient by 1.0
                current.grad_norm = grads.norm()
            current.stage()
            # Read a step before touching the weights: this one (lag 0) or the one before (lag 1).
            previous = current if lag == 0 else pending
            problem = check(previous) if previous is not None else None
            if problem:
                status, reason = "diverged", problem
                break
            decision = report(previous) if lag and previous is not None else Decision.CONTINUE
            precision.step(optimizer)
            grads.after_step()
            if sched_interval == "step":
                scheduler.step()
            step += 1
            current.lr = current_lr(optimizer)
            if lag == 0:
                decision = report(current)
            pending, current = (current if lag else None), PendingStep(step + 1, epoch)
            if decision is Decision.INTERRUPT:
                status, reason = "interrupted", f"interrupted at step {step} (epoch {epoch}); checkpoint saved"
                break
        # ---- the epoch's last step (lag 1: still unread), then its sums
        if pending is not None and status != "diverged":
            problem = check(pending)
            if problem:
                status, reason = "diverged", problem
            elif report(pending) is Decision.INTERRUPT and status == "completed":
                status, reason = "interrupted", f"interrupted at step {step} (epoch {epoch}); checkpoint saved"
        correct += float(torch.cat(hits).sum()) if hits else 0.0
        train_time += time.perf_counter() - t0
        if status == "interrupted":
            loss_sum, correct, seen = ctx.all_reduce_sum([loss_sum, correct, seen], device)
            if out is not None and ctx.is_main and cfg.save_checkpoints:
                ckpt.save_last(make_state(epoch, {"next_batch": last_i + 1, "world_size": ctx.world_size,
                                                  "sums": (loss_sum, correct, seen, train_time)}), out)
        if status != "completed":
            break

        # ---- validate
        loss_sum, correct, seen = ctx.all_reduce_sum([loss_sum, correct, seen], device)
        val_loss, val_acc = _evaluate(fwd_model, val_loader, criterion, device, precision, ctx)
        metrics = {
            "train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1),
            "val_loss": val_loss, "val_acc": val_acc, "lr": current_lr(optimizer), "grad_norm": grad_norm,
            "samples_per_s": seen / max(train_time, 1e-9), "epoch_time_s": train_time,
            "peak_mem_mb": _peak_memory_mb(device), "skipped_steps": float(precision.skipped_steps),
        }
        monitored = metrics[cfg.monitor]
        improved = best is None or (monitored < best if cfg.monitor_mode == "min" else monitored > best)
        if improved:
            best, best_epoch = monitored, epoch
        history.append({"epoch": epoch, "step": step, **metrics})

        # ---- schedule, checkpoint, then report (a kill after the report still finds the checkpoint)
        if sched_interval == "epoch":
            scheduler.step()
        elif sched_interval == "plateau":
            scheduler.step(monitored)
        if out is not None and ctx.is_main and cfg.save_checkpoints:
            state = make_state(epoch, None)
            ckpt.save_last(state, out)
            if improved:
                ckpt.save_checkpoint(state, out / ckpt.BEST)
        decision = _agree(reporter.report_epoch(epoch, step, metrics), ctx, device)
        if decision is Decision.PRUNE:
            status, reason = "pruned", f"pruned after epoch {epoch} ({cfg.monitor}={monitored:.6g})"
            break
        if decision is Decision.INTERRUPT:
            status, reason = "interrupted", f"interrupted after epoch {epoch}; checkpoint saved"
            break

    result = TrainResult(
        status=status, reason=reason, epochs_completed=len(history), steps_completed=step,
        metrics=metrics, best_metric=best, best_epoch=best_epoch, history=history,
        global_batch_size=global_batch, skipped_steps=precision.skipped_steps,
    )
    if out is not None and ctx.is_main:
        if (out / ckpt.LAST).exists():
            result.checkpoint_last = out / ckpt.LAST
        if (out / ckpt.BEST).exists():
            result.checkpoint_best = out / ckpt.BEST
        if status == "completed":
            from core.finalize import finalize_run  # evaluation + ONNX export of the best weights

            finalize_run(task, cfg, model, val_ds, device, out, reporter, result)
    return result


def _forward(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor,
             mixup_alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    if mixup_alpha <= 0:
        logits = model(x)
        return logits, criterion(logits, y)
    # Mixup: blend each sample with a shuffled partner; the loss blends both labels the same way.
    lam = float(torch.distributions.Beta(mixup_alpha, mixup_alpha).sample())
    perm = torch.randperm(x.shape[0], device=x.device)
    logits = model(lam * x + (1 - lam) * x[perm])
    return logits, lam * criterion(logits, y) + (1 - lam) * criterion(logits, y[perm])


def _evaluate(model: nn.Module, loader, criterion: nn.Module, device: torch.device,
              precision: Precision, ctx: DistContext) -> tuple[float, float]:
    model.eval()
    loss_sum, correct, seen = 0.0, 0.0, 0.0
    with torch.inference_mode(), precision.autocast():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            # Sum, not mean, so batches of different sizes weigh by their sample count.
            loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.shape[0]
    loss_sum, correct, seen = ctx.all_reduce_sum([loss_sum, correct, seen], device)
    return loss_sum / max(seen, 1), correct / max(seen, 1)


def _agree(decision: Decision, ctx: DistContext, device: torch.device) -> Decision:
    """Rank 0's decision on every rank (a no-op in single-process runs)."""
    if not ctx.enabled:
        return decision
    return _DECISIONS[ctx.broadcast_int(_DECISIONS.index(decision), device)]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _write_json(obj: dict, path: Path) -> None:
    from core.io_utils import save_json_atomic

    save_json_atomic(obj, path)
