"""Trainer overhead: samples/s of ``core.train()`` against a minimal hand-written PyTorch loop.

Both sides train the same model on the same data with the same batch size, number of steps,
optimizer (SGD, momentum 0.9, weight decay 5e-4, constant lr), fp32 and DataLoader settings
(in-process loading, no pinning). ``core.train()`` runs the way a sweep trial runs it: with a
real ``sweeps.trial.TrialReporter`` on the ``MlflowTracker`` an Optuna worker uses
(SQLite in a temp folder), so every optimizer step is tracked. No checkpoints, no ONNX export.

Two measurements of the same ratio:

* lockstep (the target's measure, for both models): ``core.train()`` drives and the hand loop
  takes one timed step after each of core's steps (``benchmarks/hand_loop.py``), so the VM's
  drift in speed cancels step by step; the digits CNN's runs alternate tracking on and off,
  ResNet-18's (1.2 s steps, 12 pairs a run) are all tracked;
* whole runs (a cross-check for the digits CNN): hand and core runs alternate (ABAB), core timed
  by its own per-epoch timer (``epoch_time_s``: the micro-batch loop with data loading, forward,
  backward, step and per-step reporting; not validation), the hand loop by a timer around its
  batches, plus the median interval between consecutive optimizer steps on both sides. Whole
  ResNet-18 runs are not used: pairs of 6-step runs spread by +-8% on this VM.

Then a per-step cost breakdown of what ``core.train()`` does that the hand loop does not
(loss and accuracy reads, the gradient norm, the reporter, the sampler, the precision
wrapper), each timed in isolation on the real model, as a share of one hand step.
"""
from __future__ import annotations

import contextlib
import statistics
import time

from benchmarks.common import Context, alternate, arm, make_row, paired_ratio, stats
from benchmarks.hand_loop import HandStepper, Lockstep, StepClock, hand_loop

NAME = "trainer_overhead"
TITLE = "Trainer overhead: core.train() (MLflow tracking on) vs a hand-written PyTorch loop"
TARGET_RATIO = 0.97


def cases(ctx: Context) -> dict[str, dict]:
    """Model, data and loop sizes per case (quick: a few steps, just the code path)."""
    return {
        "digits_cnn": {"task": ("digits", {"model": "cnn"}), "batch_size": 32, "share": 0.35,
                       "epochs": ctx.pick(1, 3), "max_steps": ctx.pick(10, None), "repeats": ctx.n_repeats(7),
                       "lockstep": {"epochs": ctx.pick(1, 3), "max_steps": ctx.pick(4, None),
                                    "runs": ctx.n_repeats(7), "share": 0.3,
                                    "arms": ("tracked", "untracked", "fused hand")},
                       # what breakdown() costs, in hand steps: blocks of 30 steps, and cheap calls
                       "breakdown_steps": 400},
        # 1.2 s steps: lockstep only, tracked only (3 points a second cost it nothing measurable),
        # 12 step pairs a run; no whole runs, whose pairs of 6 steps spread +-8% on this VM.
        "resnet18_synthetic32": {"task": ("synthetic", {"model": "resnet18", "shape": [3, 32, 32],
                                                        "n_train": 512, "n_val": 32}),
                                 "batch_size": 32, "epochs": 1, "max_steps": ctx.pick(3, 13),
                                 "lockstep": {"epochs": 1, "max_steps": ctx.pick(3, 13), "runs": ctx.n_repeats(3),
                                              "arms": ("tracked",)},
                                 "breakdown_steps": 12},  # 1 warm-up + 3 timed steps, norms, loader passes
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
                       save_checkpoints=False, export_onnx=False,
                       # the diagnostics (issue 29) off, as by default: what they cost when off is in the figures
                       profile=None, export_torchscript=None, detect_anomaly=False)


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


def lockstep(task, case: dict, store, name: str, ctx: Context, budget_s: float = float("inf"),
             reserve_steps: int = 0) -> dict:
    """Core and the hand loop one step each in turn (see benchmarks/hand_loop.py), in runs that
    alternate tracking on (TrialReporter on an MlflowTracker, as in a sweep) and off
    (NullReporter), and, as arm "fused hand", tracked core beside a hand loop on SGD's fused
    kernel, as core's own is. Returns per-run ratios of core's samples/s over the hand loop's.
    Runs after the first stop once ``budget_s`` (this case's share) would be overrun, or the
    benchmark's budget less ``reserve_steps`` hand steps (kept for the breakdown that follows)."""
    from core.reporting import NullReporter
    from core.train import train

    sizes = case["lockstep"]
    cfg = train_config({**case, "epochs": sizes["epochs"], "max_steps": sizes["max_steps"]})
    arms = sizes.get("arms", ("tracked", "untracked"))
    ratios: dict[str, list[float]] = {arm_name: [] for arm_name in arms}
    steps_s: dict[str, list[float]] = {"hand": [], **{arm_name: [] for arm_name in arms}}  # "hand": default SGD
    t0 = time.monotonic()
    for r in range(sizes["runs"]):
        # The first run always happens; the next only if it fits in this case's share of the budget.
        per_run = (time.monotonic() - t0) / max(r, 1)
        reserve_s = reserve_steps * statistics.median(steps_s["hand"]) if steps_s["hand"] else 0.0
        if r >= 1 and (time.monotonic() - t0 + 1.1 * per_run > budget_s
                       or not ctx.can_afford(1.1 * per_run + reserve_s, f"{name} lockstep runs {r + 1}-")):
            if time.monotonic() - t0 + 1.1 * per_run > budget_s:
                ctx.cut.append(f"{name} lockstep runs {r + 1}-{sizes['runs']} (about {1.1 * per_run:.0f} s each) "
                               f"left out: this case's share of the time budget ({budget_s:.0f} s) was spent")
            break
        for arm_name in arms:
            reporter, run_ = (NullReporter(), None) if arm_name == "untracked" else \
                store.trial_reporter(f"{name}-lockstep-{r}")
            # Both sides start each run with a new model.
            pace = Lockstep(reporter, HandStepper(task, cfg, fused=arm_name == "fused hand"))
            train(task, cfg, reporter=pace)
            if run_ is not None:
                store.tracker.end_run(run_, "FINISHED")
            ratios[arm_name].append(pace.ratio())
            steps_s[arm_name] += pace.core_s
            if arm_name != "fused hand":
                steps_s["hand"] += pace.hand_s
            ctx.log(f"  lockstep run {r + 1}/{sizes['runs']} {arm_name}: core/hand {pace.ratio():.4f} "
                    f"over {len(pace.core_s)} step pairs")
    return {"ratios": ratios, "step_ms": {k: stats(1e3 * v for v in vs) for k, vs in steps_s.items()},
            "step_pairs_per_run": len(pace.core_s),  # every run has as many (same config)
            "config": {"epochs": sizes["epochs"], "max_steps": sizes["max_steps"]}}


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
    from core.gradients import StepGradients
    from core.optim import build_optimizer, current_lr, param_groups
    from core.precision import Precision

    torch.manual_seed(0)
    model = task.build_model()
    model.train()
    train_ds, _ = task.datasets()
    plain = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0,
                       generator=torch.Generator().manual_seed(0))
    x, y = next(iter(plain))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)  # the hand loop's
    core_optimizer = build_optimizer(param_groups(model, cfg, None), cfg)  # core's: fused on CPU
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
    grads = StepGradients(params, device, distributed=False)  # as core.train holds them on CPU
    logits = model(x)
    loss = criterion(logits, y)
    loss.backward()  # gradients exist for the norm

    norm_calls = max(2, cheap_calls // 10) if heavy else cheap_calls

    reporter, run = store.trial_reporter("breakdown")
    counter = iter(range(1, 10**9))
    metrics = {"train_loss": 0.5, "lr": 0.05, "grad_norm": 1.0}

    costs = {
        "loss.item()": _time_per_call(lambda: loss.item(), cheap_calls, blocks),
        # core keeps each step's (argmax == y) and sums them once at the epoch's end
        "accuracy: logits.argmax(1) == y":
            _time_per_call(lambda: logits.argmax(1) == y, cheap_calls, blocks),
        # Without clipping, core measures the norm only: one reduction over the pooled small
        # gradients, per-tensor norms for the large ones (core.gradients.StepGradients).
        "grad norm: StepGradients.norm() (pooled small gradients + per-tensor large ones)":
            _time_per_call(lambda: float(grads.norm()), norm_calls, blocks),
        "optimizer step: SGD's fused kernel (core on CPU) instead of the default (hand loop)":
            _time_per_call(core_optimizer.step, norm_calls, blocks)
            - _time_per_call(optimizer.step, norm_calls, blocks),
        "reporter.report_step (TrialReporter -> MlflowTracker buffer)":
            _time_per_call(lambda: reporter.report_step(next(counter), metrics), cheap_calls, blocks),
        "loop bookkeeping: x/y .to(device), autocast ctx, loss / group_size, unscale_, current_lr":
            _time_per_call(lambda: (x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                                    precision.autocast().__enter__(), contextlib.nullcontext().__enter__(),
                                    loss.detach() / 1, precision.unscale_(optimizer), current_lr(optimizer)),
                           cheap_calls, blocks),
    }
    # The loader: core gathers an in-memory dataset's batches by index (core/in_memory.py), else
    # shuffles with a DistributedSampler and seeds each batch's data randomness (core/data.py);
    # the hand loop shuffles with a RandomSampler through a DataLoader.
    core_batches = make_train_loader(train_ds, cfg, torch.device("cpu"), DistContext())
    n_batches = len(core_batches)

    def one_pass(batches) -> float:
        t0 = time.perf_counter()
        for _ in batches:
            pass
        return (time.perf_counter() - t0) / n_batches

    def core_pass() -> float:
        return one_pass(core_batches.epoch(0))

    core_pass(), one_pass(plain)
    passes = [(core_pass(), one_pass(plain)) for _ in range(ctx.pick(1, 5))]  # alternating
    t_core = statistics.median(c for c, _ in passes)
    t_plain = statistics.median(p for _, p in passes)
    costs["core's batches (in-memory gather, or DistributedSampler + per-batch data seeds) instead of "
          "RandomSampler (per batch)"] = statistics.median(c - p for c, p in passes)

    store.tracker.end_run(run, "FINISHED")

    total = sum(costs.values())
    return {
        "hand_step_s": step_s,
        "per_step_costs_us": {k: round(v * 1e6, 2) for k, v in costs.items()},
        "per_step_costs_pct_of_hand_step": {k: round(100 * v / step_s, 3) for k, v in costs.items()},
        "sum_of_extras_us": round(total * 1e6, 2),
        "sum_of_extras_pct": round(100 * total / step_s, 3),
        "predicted_ratio": step_s / (step_s + total),
        "loader_per_batch_us": {f"core ({type(core_batches).__name__})": round(t_core * 1e6, 2),
                                "hand (RandomSampler)": round(t_plain * 1e6, 2)},
    }


# --------------------------------------------------------------------------- the benchmark


def lockstep_row(case_name: str, paced: dict) -> dict:
    """The target's row: core's samples/s over the hand loop's, step pair by step pair."""
    tracked = {**stats(paced["ratios"]["tracked"]),
               "definition": "per run: hand step time / core step time, summed over the run's lockstep pairs "
                             "(core samples/s over the hand loop's)"}
    untracked = stats(paced["ratios"]["untracked"]) if "untracked" in paced["ratios"] else None
    fused = stats(paced["ratios"]["fused hand"]) if "fused hand" in paced["ratios"] else None
    aside = f"untracked: {untracked['median']:.3f}x; " if untracked else ""
    if fused:
        aside += f"against a hand loop on the fused SGD kernel too: {fused['median']:.3f}x; "
    return make_row(
        f"{case_name} lockstep", metric="samples/s over each run's step pairs (core step, then a hand step)",
        baseline={"label": "hand-written loop, step ms", **paced["step_ms"]["hand"]},
        candidate={"label": "core.train() + TrialReporter/MLflow, step ms", **paced["step_ms"]["tracked"]},
        ratio=tracked, target=f">= {TARGET_RATIO}", meets_target=tracked["median"] >= TARGET_RATIO,
        headline=f"core.train() runs at {tracked['median']:.3f}x the hand loop's samples/s, step for step "
                 f"({aside}{paced['step_pairs_per_run']} step pairs per run, {tracked['n']} runs)",
        details={**paced, "untracked_ratio": untracked, "fused_hand_ratio": fused})


def whole_runs_row(task, case_name: str, case: dict, cfg, store, ctx: Context) -> dict:
    """The cross-check: hand and core runs alternate (ABAB), each timed whole."""
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

    warmup = 0 if ctx.quick else 1  # a warm-up pair, discarded: imports, allocator, kernel caches
    # share: of the time left, what this case may spend on its ABAB rounds (the rest is breakdowns)
    values = alternate({"hand": hand, "core": core}, repeats=case["repeats"], warmup=warmup, log=ctx.log,
                       ctx=ctx, what=case_name, budget_s=case["share"] * ctx.time_left() * 0.85)
    measured = {k: v[warmup:] for k, v in raw.items()}
    ratio = paired_ratio(values["core"], values["hand"], "core samples/s / hand samples/s (per ABAB pair)")
    interval_ratio = paired_ratio([r["step_interval_s"] for r in measured["hand"]],
                                  [r["step_interval_s"] for r in measured["core"]],
                                  "hand median step interval / core median step interval")
    cpu_ratio = paired_ratio([r["step_cpu_s"] for r in measured["hand"]],
                             [r["step_cpu_s"] for r in measured["core"]],
                             "hand median step CPU time / core median step CPU time")
    return make_row(
        f"{case_name} whole runs", metric="training samples/s (epoch timer; validation excluded)",
        baseline=arm("hand-written loop", values["hand"]), candidate=arm("core.train() + TrialReporter/MLflow",
                                                                         values["core"]),
        ratio=ratio, target=None, meets_target=None,
        headline=f"core.train() runs at {ratio['median']:.3f}x the hand loop's samples/s, whole runs ABAB "
                 f"(median step: {interval_ratio['median']:.3f}x wall, {cpu_ratio['median']:.3f}x CPU time)",
        details={"config": {k: case[k] for k in ("batch_size", "epochs", "max_steps")},
                 "samples_per_run": measured["hand"][0]["samples"] if measured["hand"] else None,
                 "core_steps_per_run": measured["core"][0]["steps"] if measured["core"] else None,
                 "step_interval_ratio": interval_ratio, "step_cpu_ratio": cpu_ratio,
                 "step_cpu_s": {"hand": stats(r["step_cpu_s"] for r in measured["hand"]),
                                "core": stats(r["step_cpu_s"] for r in measured["core"])},
                 "step_interval_s": {"hand": stats(r["step_interval_s"] for r in measured["hand"]),
                                     "core": stats(r["step_interval_s"] for r in measured["core"])},
                 "core_wall_s": stats(r["wall_s"] for r in measured["core"])})


def run(ctx: Context) -> dict:
    from benchmarks.sweeps_runs import TrackingStore

    threads = ctx.torch_threads()
    store = ctx.closing(TrackingStore(ctx.workdir / "mlflow"))
    rows, details = [], {}
    only = ctx.options.get("cases")
    for case_name, case in cases(ctx).items():
        if only and case_name not in only:
            continue
        sizes = case["lockstep"]
        ctx.log(f"{NAME}: {case_name} (batch {case['batch_size']}; lockstep: {sizes['runs']} runs of "
                f"{sizes['epochs']} epochs, max_steps_per_epoch {sizes['max_steps']}"
                + (f"; whole runs: {case['repeats']} ABAB pairs)" if "repeats" in case else ")"))
        task = make_task(case["task"])
        cfg = train_config(case)
        paced = lockstep(task, case, store, case_name, ctx, budget_s=sizes.get("share", 1.0) * ctx.time_left(),
                         reserve_steps=case["breakdown_steps"])
        rows.append(lockstep_row(case_name, paced))
        ctx.keep(rows)
        if "repeats" in case:
            rows.append(whole_runs_row(task, case_name, case, cfg, store, ctx))
            ctx.keep(rows)
        hand_step_s = paced["step_ms"]["hand"]["median"] / 1e3
        if ctx.can_afford(case["breakdown_steps"] * hand_step_s, f"{case_name} per-step breakdown"):
            ctx.log(f"{NAME}: {case_name} breakdown")
            details[case_name] = breakdown(task, cfg, store, ctx)
            rows[-1]["details"]["breakdown"] = details[case_name]
            ctx.keep(rows)

    summary_bits = [f"{r['case']} {r['ratio']['median']:.3f}x" for r in rows]
    return {
        "target": f"core.train() samples/s >= {TARGET_RATIO} x the hand loop's, for each model",
        "summary": "Trainer overhead (core.train() with MLflow tracking vs hand loop, samples/s ratio): "
                   + ", ".join(summary_bits) + f" (target >= {TARGET_RATIO}, judged on the lockstep rows)",
        "rows": rows,
        "notes": [
            f"torch threads: {threads} (see README: Load).",
            "Lockstep (the target's measure for both models): core.train() drives, and after each of its "
            "optimizer steps the hand loop takes one step of its own, timed; the ratio is the hand's summed step "
            "time over core's within one run, so the VM's drift in speed (10-15% within seconds here) cancels "
            "step by step. The digits CNN's runs alternate tracking on, off, and on beside a hand loop that uses "
            "SGD's fused kernel too; ResNet-18's are all tracked, beside the plain hand loop. See "
            "benchmarks/hand_loop.py.",
            "Whole runs (a cross-check for the digits CNN): hand and core runs alternate (ABAB), each ratio from "
            "one pair of runs; beside it the median interval between consecutive optimizer steps, in wall and "
            "process CPU time. Its spread is that drift: two whole runs of the same loop differ by as much.",
            "Both sides: SGD(momentum 0.9, wd 5e-4), constant lr, fp32, batch 32, num_workers 0, no clipping; "
            "core.train() still computes the gradient norm every step (it reports it). On CPU core runs SGD's "
            "fused kernel (core/optim.py), the hand loop the default a tutorial gets: the judged ratio includes "
            "that saving; the 'fused hand' arm and the breakdown's optimizer line show it apart.",
            "Throughput counts only the training loop of each epoch (validation, which only core runs, is excluded).",
            "The training diagnostics are off, as by default (train.profile null, export_torchscript null, "
            "detect_anomaly false, no checkpoint_blocks): core's figures include what they cost when off, one "
            "'profiler is None' test a step; diverged.json is written only once a run has diverged.",
            "Step points are buffered by the tracker from report_step, inside the timed steps, and written to the "
            "store by the trainer when a batch is due; what the store costs per run (end_run included) is "
            "measured in the tracking_overhead benchmark.",
        ],
        "details": {"breakdown": details},
    }

