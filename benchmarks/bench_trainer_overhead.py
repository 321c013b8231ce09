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

from benchmarks.common import Context, alternate, arm, bench_main, make_row, paired_ratio, stats

NAME = "trainer_overhead"
TITLE = "Trainer overhead: core.train() (MLflow tracking on) vs a hand-written PyTorch loop"
TARGET_RATIO = 0.97


def cases(ctx: Context) -> dict[str, dict]:
    """Model, data and loop sizes per case (quick: a few steps, just the code path)."""
    return {
        "digits_cnn": {"task": ("digits", {"model": "cnn"}), "batch_size": 32, "share": 0.35,
                       "epochs": ctx.pick(1, 3), "max_steps": ctx.pick(10, None), "repeats": ctx.n_repeats(7)},
        "resnet18_synthetic32": {"task": ("synthetic", {"model": "resnet18", "shape": [3, 32, 32],
                                                        "n_train": 512, "n_val": 32}),
                                 "batch_size": 32, "epochs": ctx.pick(1, 2), "max_steps": ctx.pick(2, 3), "share": 0.85,
                                 "repeats": ctx.n_repeats(4), "prime_only": True},
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
        self.stamps: list[list[tuple[float, float]]] = [[]]  # (wall, process CPU) per step, per epoch

    def report_step(self, step, metrics):
        self.stamps[-1].append((time.perf_counter(), time.process_time()))
        return self.inner.report_step(step, metrics)

    def report_epoch(self, epoch, step, metrics):
        self.stamps.append([])
        return self.inner.report_epoch(epoch, step, metrics)

    def log_artifact(self, path, kind):
        return self.inner.log_artifact(path, kind)

    def intervals(self, which: int = 0) -> list[float]:
        return [b[which] - a[which] for epoch in self.stamps for a, b in zip(epoch, epoch[1:])]


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hand_loop(task, cfg, faults: bool = False) -> dict:
    """The minimal loop: DataLoader(shuffle) -> forward -> loss -> zero_grad -> backward -> step.
    ``faults``: also count minor page faults per step (a getrusage call per step)."""
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
    seen, train_time, intervals, cpu_intervals, fault_counts = 0, 0.0, [], [], []
    for _epoch in range(cfg.epochs):
        model.train()
        t0 = time.perf_counter()
        last = last_cpu = last_faults = None
        for i, (x, y) in enumerate(loader):
            if i >= steps:
                break
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += y.shape[0]
            now, now_cpu = time.perf_counter(), time.process_time()
            now_faults = minor_faults() if faults else 0
            if last is not None:
                intervals.append(now - last)
                cpu_intervals.append(now_cpu - last_cpu)
                fault_counts.append(now_faults - last_faults)
            last, last_cpu, last_faults = now, now_cpu, now_faults
        train_time += time.perf_counter() - t0
    return {"samples_per_s": seen / train_time, "samples": seen, "train_time_s": train_time,
            "step_interval_s": statistics.median(intervals) if intervals else float("nan"),
            "step_cpu_s": statistics.median(cpu_intervals) if cpu_intervals else float("nan"),
            "step_faults": statistics.median(fault_counts) if faults and fault_counts else float("nan")}


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
    intervals, cpu_intervals = clock.intervals(0), clock.intervals(1)
    return {"samples_per_s": seen / train_time, "samples": round(seen), "train_time_s": train_time, "wall_s": wall,
            "steps": result.steps_completed, "status": result.status,
            "step_interval_s": statistics.median(intervals) if intervals else float("nan"),
            "step_cpu_s": statistics.median(cpu_intervals) if cpu_intervals else float("nan")}


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
    device = torch.device("cpu")
    precision = Precision(cfg.precision, device)
    heavy = sum(p.numel() for p in params) > 1_000_000
    blocks = ctx.pick(1, 3 if heavy else 7)
    step_calls = 1 if heavy else ctx.pick(5, 30)
    cheap_calls = ctx.pick(10, 200)

    def hand_step():
        loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step_s = _time_per_call(hand_step, step_calls, blocks)
    logits = model(x)
    loss = criterion(logits, y)
    loss.backward()  # gradients exist for the norm

    total_norm = nn.utils.get_total_norm([p.grad for p in params])
    norm_calls = max(2, cheap_calls // 10) if heavy else cheap_calls

    reporter, run = store.trial_reporter("breakdown")
    counter = iter(range(1, 10**9))
    metrics = {"train_loss": 0.5, "lr": 0.05, "grad_norm": 1.0}

    costs = {
        "loss.item()": _time_per_call(lambda: loss.item(), cheap_calls, blocks),
        "accuracy: (logits.argmax(1) == y).sum().item()":
            _time_per_call(lambda: (logits.argmax(1) == y).sum().item(), cheap_calls, blocks),
        # core calls float(clip_grad_norm_(params, max_norm=grad_clip or inf)) every step: the norm
        # (one reduction per gradient + a stack + a sync), then a rescale of every gradient by
        # min(max_norm / norm, 1), which is a multiply by 1.0 when clipping is off. Timed apart:
        "grad norm: float(get_total_norm(grads))":
            _time_per_call(lambda: float(nn.utils.get_total_norm([p.grad for p in params])),
                           norm_calls, blocks),
        "grad rescale by 1.0: clip_grads_with_norm_(params, inf, norm)":
            _time_per_call(lambda: nn.utils.clip_grads_with_norm_(params, float("inf"), total_norm),
                           norm_calls, blocks),
        "reporter.report_step (TrialReporter -> MlflowTracker buffer)":
            _time_per_call(lambda: reporter.report_step(next(counter), metrics), cheap_calls, blocks),
        "loop bookkeeping: x/y .to(device), autocast ctx, loss / group_size, unscale_, current_lr":
            _time_per_call(lambda: (x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                                    precision.autocast().__enter__(), contextlib.nullcontext().__enter__(),
                                    loss.detach() / 1, precision.unscale_(optimizer), current_lr(optimizer)),
                           cheap_calls, blocks),
    }
    # The loader: core shuffles with a DistributedSampler (world size 1); the hand loop with a RandomSampler.
    core_loader = make_train_loader(train_ds, cfg, torch.device("cpu"), DistContext())
    n_batches = len(core_loader)

    def one_pass(loader) -> float:
        t0 = time.perf_counter()
        for _ in loader:
            pass
        return (time.perf_counter() - t0) / n_batches

    one_pass(core_loader), one_pass(plain)
    passes = [(one_pass(core_loader), one_pass(plain)) for _ in range(ctx.pick(1, 5))]  # alternating
    t_core = statistics.median(c for c, _ in passes)
    t_plain = statistics.median(p for _, p in passes)
    costs["DistributedSampler instead of RandomSampler (per batch)"] = statistics.median(c - p for c, p in passes)

    # What the epoch-end flush of one epoch's step points costs (outside core's epoch timer).
    steps_per_epoch = n_batches if cfg.max_steps_per_epoch is None else min(n_batches, cfg.max_steps_per_epoch)
    store.tracker.flush(run)  # what report_step buffered above
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
    from benchmarks.sweeps_runs import TrackingStore

    threads = ctx.torch_threads()
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

        # A warm-up pair (discarded), or for the expensive model a 1-step priming run of each side.
        warmup = 0 if ctx.quick or case.get("prime_only") else 1
        if warmup == 0:  # pay the first-call costs (imports, allocator, kernel caches) outside the timing
            core_run(task, train_config({**case, "epochs": 1, "max_steps": 1}), store, f"{case_name}-prime")
            hand_loop(task, train_config({**case, "epochs": 1, "max_steps": 1}))
        # share: of the time left, what this case may spend on its ABAB rounds (the rest is breakdowns)
        values = alternate({"hand": hand, "core": core}, repeats=case["repeats"], warmup=warmup, log=ctx.log,
                           ctx=ctx, what=case_name, budget_s=case["share"] * ctx.time_left() * 0.85)
        measured = {k: v[warmup:] for k, v in raw.items()}  # drop the warm-up pair
        ratio = paired_ratio(values["core"], values["hand"], "core samples/s / hand samples/s (per ABAB pair)")
        interval_ratio = paired_ratio([r["step_interval_s"] for r in measured["hand"]],
                                      [r["step_interval_s"] for r in measured["core"]],
                                      "hand median step interval / core median step interval")
        cpu_ratio = paired_ratio([r["step_cpu_s"] for r in measured["hand"]],
                                 [r["step_cpu_s"] for r in measured["core"]],
                                 "hand median step CPU time / core median step CPU time")
        ctx.log(f"{NAME}: {case_name} breakdown")
        parts = breakdown(task, cfg, store, ctx)
        meets = ratio["median"] >= TARGET_RATIO
        rows.append(make_row(
            case_name, metric="training samples/s (epoch timer; validation excluded)",
            baseline=arm("hand-written loop", values["hand"]), candidate=arm("core.train() + TrialReporter/MLflow",
                                                                             values["core"]),
            ratio=ratio, target=f">= {TARGET_RATIO}", meets_target=meets,
            headline=f"core.train() runs at {ratio['median']:.3f}x the hand loop's samples/s "
                     f"(median step: {interval_ratio['median']:.3f}x wall, {cpu_ratio['median']:.3f}x CPU time)",
            details={"config": {k: case[k] for k in ("batch_size", "epochs", "max_steps")},
                     "samples_per_run": measured["hand"][0]["samples"] if measured["hand"] else None,
                     "core_steps_per_run": measured["core"][0]["steps"] if measured["core"] else None,
                     "step_interval_ratio": interval_ratio, "step_cpu_ratio": cpu_ratio,
                     "step_cpu_s": {"hand": stats(r["step_cpu_s"] for r in measured["hand"]),
                                    "core": stats(r["step_cpu_s"] for r in measured["core"])},
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
            f"torch threads: {threads} (see README: Load). Cross-checks next to the epoch-timer ratio: the median "
            "interval between consecutive optimizer steps, in wall time and in process CPU time (robust to bursts "
            "of load from other processes).",
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
