"""Trainer overhead: samples/s of ``core.train()`` against a minimal hand-written PyTorch loop.

Both sides train the same model on the same data with the same batch size, number of steps,
optimizer (SGD, momentum 0.9, weight decay 5e-4, constant lr), fp32 and DataLoader settings
(in-process loading, no pinning). ``core.train()`` runs the way a sweep trial runs it: with a
real ``sweeps.objective.TrialReporter`` on a real ``MlflowTracker`` (SQLite in a temp folder),
so every optimizer step is tracked. No checkpoints, no ONNX export.

Throughput is training time only: ``core.train()``'s own per-epoch timer (``epoch_time_s``, the
micro-batch loop with data loading, forward, backward, step, per-step reporting; not validation)
against a timer around the hand loop's batches. As a cross-check that does not rely on core's
timer, the median interval between consecutive optimizer steps is measured on both sides
(a wrapper reporter timestamps core's steps). Runs alternate hand, core, hand, core (ABAB);
each ratio is core / hand within one pair.

Then a per-step cost breakdown of what ``core.train()`` does that the hand loop does not
(loss and accuracy ``.item()``, the gradient-norm computation, the reporter, the sampler, the
precision wrapper), each timed in isolation on the real model, as a share of one hand step.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

from benchmarks.common import Context, alternate, arm, bench_main, make_row, paired_ratio, stats

NAME = "trainer_overhead"
TITLE = "Trainer overhead: core.train() (MLflow tracking on) vs a hand-written PyTorch loop"
TARGET_RATIO = 0.97


def cases(ctx: Context) -> dict[str, dict]:
    """Model, data and loop sizes per case (quick: a few steps, just the code path)."""
    return {
        "digits_cnn": {"task": ("digits", {"model": "cnn"}), "batch_size": 32,
                       "epochs": ctx.pick(1, 3), "max_steps": ctx.pick(10, None), "repeats": ctx.n_repeats(7)},
        "resnet18_synthetic32": {"task": ("synthetic", {"model": "resnet18", "shape": [3, 32, 32],
                                                        "n_train": 512, "n_val": 32}),
                                 "batch_size": 32, "epochs": ctx.pick(1, 2), "max_steps": ctx.pick(2, 6),
                                 "repeats": ctx.n_repeats(4)},
    }


def make_task(spec: tuple[str, dict]):
    from core.tasks.base import make_task as _make

    name, args = spec
    args = dict(args)
    model = args.pop("model")
    return _make(name, model=model, args=args)


def train_config(case: dict):
    from core.config import TrainConfig

    return TrainConfig(epochs=case["epochs"], batch_size=case["batch_size"], max_steps_per_epoch=case["max_steps"],
                       lr=0.05, optimizer="sgd", momentum=0.9, weight_decay=5e-4, scheduler="constant",
                       precision="fp32", grad_clip=None, num_workers=0, device="cpu", seed=0,
                       save_checkpoints=False, export_onnx=False)


class StepClock:
    """Wraps a reporter and timestamps every ``report_step`` call: consecutive stamps of one
    epoch are one full optimizer step of core's loop apart (data loading included)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.stamps: list[list[float]] = [[]]

    def report_step(self, step, metrics):
        self.stamps[-1].append(time.perf_counter())
        return self.inner.report_step(step, metrics)

    def report_epoch(self, epoch, step, metrics):
        self.stamps.append([])
        return self.inner.report_epoch(epoch, step, metrics)

    def log_artifact(self, path, kind):
        return self.inner.log_artifact(path, kind)

    def intervals(self) -> list[float]:
        return [b - a for epoch in self.stamps for a, b in zip(epoch, epoch[1:])]


def hand_loop(task, cfg) -> dict:
    """The minimal loop: DataLoader(shuffle) -> forward -> loss -> zero_grad -> backward -> step."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(cfg.seed)
    model = task.build_model()
    train_ds, _ = task.datasets()
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0, pin_memory=False,
                        drop_last=False, generator=torch.Generator().manual_seed(cfg.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    criterion = nn.CrossEntropyLoss()
    steps = len(loader) if cfg.max_steps_per_epoch is None else min(len(loader), cfg.max_steps_per_epoch)
    seen, train_time, intervals = 0, 0.0, []
    for _epoch in range(cfg.epochs):
        model.train()
        t0 = time.perf_counter()
        last = None
        for i, (x, y) in enumerate(loader):
            if i >= steps:
                break
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += y.shape[0]
            now = time.perf_counter()
            if last is not None:
                intervals.append(now - last)
            last = now
        train_time += time.perf_counter() - t0
    return {"samples_per_s": seen / train_time, "samples": seen, "train_time_s": train_time,
            "step_interval_s": statistics.median(intervals) if intervals else float("nan")}


def core_run(task, cfg, store, name: str) -> dict:
    from core.train import train

    reporter, run = store.trial_reporter(name)
    clock = StepClock(reporter)
    t0 = time.perf_counter()
    result = train(task, cfg, reporter=clock)
    wall = time.perf_counter() - t0
    store.tracker.end_run(run, "FINISHED")
    seen = sum(h["samples_per_s"] * h["epoch_time_s"] for h in result.history)
    train_time = sum(h["epoch_time_s"] for h in result.history)
    intervals = clock.intervals()
    return {"samples_per_s": seen / train_time, "samples": round(seen), "train_time_s": train_time, "wall_s": wall,
            "steps": result.steps_completed, "status": result.status,
            "step_interval_s": statistics.median(intervals) if intervals else float("nan")}


# --------------------------------------------------------------------------- per-step breakdown


def _time_per_call(fn, calls: int, blocks: int) -> float:
    """Median over ``blocks`` of the mean time of ``calls`` back-to-back calls (seconds)."""
    fn()
    per = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls)
    return statistics.median(per)


def breakdown(task, cfg, store, ctx: Context) -> dict:
    """Per-step cost of each thing core.train() does beyond the hand loop, timed in isolation."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from core.data import make_train_loader
    from core.distributed import DistContext
    from core.optim import build_optimizer, current_lr, param_groups
    from core.precision import Precision

    torch.manual_seed(0)
    model = task.build_model()
    model.train()
    train_ds, _ = task.datasets()
    plain = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0,
                       generator=torch.Generator().manual_seed(0))
    x, y = next(iter(plain))
    optimizer = build_optimizer(param_groups(model, cfg, None), cfg)
    criterion = nn.CrossEntropyLoss()
    params = list(model.parameters())
    precision = Precision(cfg.precision, torch.device("cpu"))
    heavy = sum(p.numel() for p in params) > 1_000_000
    blocks = ctx.pick(3, 7)
    step_calls = ctx.pick(1, 3) if heavy else ctx.pick(5, 30)
    cheap_calls = ctx.pick(20, 200)

    def hand_step():
        loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step_s = _time_per_call(hand_step, step_calls, blocks)
    logits = model(x)
    loss = criterion(logits, y)
    loss.backward()  # gradients exist for the norm

    reporter, run = store.trial_reporter("breakdown")
    counter = iter(range(1, 10**9))
    metrics = {"train_loss": 0.5, "lr": 0.05, "grad_norm": 1.0}

    costs = {
        "loss.item()": _time_per_call(lambda: loss.item(), cheap_calls, blocks),
        "accuracy: (logits.argmax(1) == y).sum().item()":
            _time_per_call(lambda: (logits.argmax(1) == y).sum().item(), cheap_calls, blocks),
        "grad norm: float(clip_grad_norm_(params, max_norm=inf))":
            _time_per_call(lambda: float(nn.utils.clip_grad_norm_(params, max_norm=float("inf"))),
                           max(2, cheap_calls // 10) if heavy else cheap_calls, blocks),
        "reporter.report_step (TrialReporter -> MlflowTracker buffer)":
            _time_per_call(lambda: reporter.report_step(next(counter), metrics), cheap_calls, blocks),
        "precision wrappers (autocast ctx, unscale_, step bookkeeping) + current_lr":
            _time_per_call(lambda: (precision.autocast().__enter__(), precision.unscale_(optimizer),
                                    current_lr(optimizer), contextlib.nullcontext().__enter__()),
                           cheap_calls, blocks),
    }
    # The loader: core shuffles with a DistributedSampler (world size 1); the hand loop with a RandomSampler.
    core_loader = make_train_loader(train_ds, cfg, torch.device("cpu"), DistContext())
    n_batches = len(core_loader)

    def iterate(loader):
        def go():
            for _ in loader:
                pass
        return go

    rounds = ctx.pick(1, 3)
    t_core = _time_per_call(iterate(core_loader), 1, rounds) / n_batches
    t_plain = _time_per_call(iterate(plain), 1, rounds) / n_batches
    costs["DistributedSampler instead of RandomSampler (per batch)"] = t_core - t_plain

    # What the epoch-end flush of one epoch's step points costs (outside core's epoch timer).
    steps_per_epoch = n_batches if cfg.max_steps_per_epoch is None else min(n_batches, cfg.max_steps_per_epoch)
    for s in range(steps_per_epoch):
        store.tracker.log_metrics(run, {"step/train_loss": 0.5, "step/lr": 0.05, "step/grad_norm": 1.0}, s + 1)
    t0 = time.perf_counter()
    store.tracker.flush(run)
    flush_s = time.perf_counter() - t0
    store.tracker.end_run(run, "FINISHED")

    total = sum(costs.values())
    return {
        "hand_step_s": step_s,
        "per_step_costs_us": {k: round(v * 1e6, 2) for k, v in costs.items()},
        "per_step_costs_pct_of_hand_step": {k: round(100 * v / step_s, 3) for k, v in costs.items()},
        "sum_of_extras_us": round(total * 1e6, 2),
        "sum_of_extras_pct": round(100 * total / step_s, 3),
        "predicted_ratio": step_s / (step_s + total),
        "epoch_flush_s": {"points": 3 * steps_per_epoch, "seconds": flush_s,
                          "per_step_equivalent_us": round(1e6 * flush_s / steps_per_epoch, 2)},
        "loader_per_batch_us": {"core (DistributedSampler)": round(t_core * 1e6, 2),
                                "hand (RandomSampler)": round(t_plain * 1e6, 2)},
    }


# --------------------------------------------------------------------------- the benchmark


def run(ctx: Context) -> dict:
    from benchmarks.common import TrackingStore

    store = TrackingStore(ctx.workdir / "mlflow")
    rows, details = [], {}
    only = ctx.options.get("cases")
    for case_name, case in cases(ctx).items():
        if only and case_name not in only:
            continue
        ctx.log(f"{NAME}: {case_name} ({case['epochs']} epochs, batch {case['batch_size']}, "
                f"max_steps_per_epoch {case['max_steps']}, {case['repeats']} ABAB pairs)")
        task = make_task(case["task"])
        cfg = train_config(case)
        raw: dict[str, list[dict]] = {"hand": [], "core": []}
        n = iter(range(10**6))

        def hand():
            out = hand_loop(task, cfg)
            raw["hand"].append(out)
            return out["samples_per_s"]

        def core():
            out = core_run(task, cfg, store, f"{case_name}-{next(n)}")
            raw["core"].append(out)
            return out["samples_per_s"]

        warmup = ctx.pick(0, 1)
        values = alternate({"hand": hand, "core": core}, repeats=case["repeats"], warmup=warmup, log=ctx.log)
        measured = {k: v[warmup:] for k, v in raw.items()}  # drop the warm-up pair
        ratio = paired_ratio(values["core"], values["hand"], "core samples/s / hand samples/s (per ABAB pair)")
        interval_ratio = paired_ratio([r["step_interval_s"] for r in measured["hand"]],
                                      [r["step_interval_s"] for r in measured["core"]],
                                      "hand median step interval / core median step interval")
        ctx.log(f"{NAME}: {case_name} breakdown")
        parts = breakdown(task, cfg, store, ctx)
        meets = ratio["median"] >= TARGET_RATIO
        rows.append(make_row(
            case_name, metric="training samples/s (epoch timer; validation excluded)",
            baseline=arm("hand-written loop", values["hand"]), candidate=arm("core.train() + TrialReporter/MLflow",
                                                                             values["core"]),
            ratio=ratio, target=f">= {TARGET_RATIO}", meets_target=meets,
            headline=f"core.train() runs at {ratio['median']:.3f}x the hand loop's samples/s "
                     f"(step-interval cross-check {interval_ratio['median']:.3f}x)",
            details={"config": {k: case[k] for k in ("batch_size", "epochs", "max_steps")},
                     "samples_per_run": measured["hand"][0]["samples"] if measured["hand"] else None,
                     "core_steps_per_run": measured["core"][0]["steps"] if measured["core"] else None,
                     "step_interval_ratio": interval_ratio,
                     "step_interval_s": {"hand": stats(r["step_interval_s"] for r in measured["hand"]),
                                         "core": stats(r["step_interval_s"] for r in measured["core"])},
                     "core_wall_s": stats(r["wall_s"] for r in measured["core"]),
                     "breakdown": parts}))
        details[case_name] = parts

    summary_bits = [f"{r['case']} {r['ratio']['median']:.3f}x" for r in rows]
    return {
        "target": f"core.train() samples/s >= {TARGET_RATIO} x the hand loop's, for each model",
        "summary": "Trainer overhead (core.train() with MLflow tracking vs hand loop, samples/s ratio): "
                   + ", ".join(summary_bits) + f" (target >= {TARGET_RATIO})",
        "rows": rows,
        "notes": [
            "Both sides: SGD(momentum 0.9, wd 5e-4), constant lr, fp32, batch 32, num_workers 0, no clipping; "
            "core.train() still computes the gradient norm every step (it reports it).",
            "Throughput counts only the training loop of each epoch (validation, which only core runs, is excluded).",
            "The epoch-end MLflow flush happens in report_epoch, outside core's epoch timer: it is measured in "
            "the tracking_overhead benchmark (whole train() calls).",
        ],
        "details": {"breakdown": details},
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(NAME, TITLE, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
