"""Tracking overhead: the same ``core.train()`` run with MLflow tracking on and off.

* off: ``NullReporter`` (what a plain ``train()`` call does);
* batched (the product): ``sweeps.objective.TrialReporter`` on ``MlflowTracker`` with a SQLite store
  in a temp folder: per-step points are buffered, flushed once per epoch and at ``end_run``;
* naive (the anchor): a reporter that sends every point at once with ``MlflowClient.log_metric``,
  one store round trip per point, as a fluent-API loop would.

Timed: the ``train()`` call plus the run's ``end_run`` / ``set_terminated`` (where the batched
tracker sends what is still buffered). Creating the run is per-trial set-up, timed separately.
Rounds alternate off, batched, naive (ABAB...); each ratio is taken inside one round.
After each tracked run the store is read back: every step's points must be there.
A second, low-noise estimate: the time spent inside the reporter's calls during the run.
"""
from __future__ import annotations

import time

from benchmarks.common import Context, arm, bench_main, make_row, paired_ratio, stats

NAME = "tracking_overhead"
TITLE = "Tracking overhead: core.train() with batched MLflow tracking vs none vs per-point log_metric"
TARGET_OVERHEAD = 0.02


class CallTimer:
    """Wraps a reporter and adds up the wall time spent inside its calls."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def report_step(self, step, metrics):
        return self._timed(self.inner.report_step, step, metrics)

    def report_epoch(self, epoch, step, metrics):
        return self._timed(self.inner.report_epoch, epoch, step, metrics)

    def log_artifact(self, path, kind):
        return self._timed(self.inner.log_artifact, path, kind)


class NaiveReporter:
    """One ``MlflowClient.log_metric`` round trip per point (the anti-pattern, as the anchor)."""

    def __init__(self, client, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def report_step(self, step, metrics):
        from core.reporting import Decision

        for k, v in metrics.items():
            self.client.log_metric(self.run_id, f"step/{k}", float(v), step=step)
        return Decision.CONTINUE

    def report_epoch(self, epoch, step, metrics):
        from core.reporting import Decision

        for k, v in metrics.items():
            self.client.log_metric(self.run_id, k, float(v), step=epoch)
        return Decision.CONTINUE

    def log_artifact(self, path, kind):
        return None


def run(ctx: Context) -> dict:
    from benchmarks.bench_trainer_overhead import make_task, train_config
    from benchmarks.common import TrackingStore
    from core.reporting import NullReporter
    from core.results import EPOCH_METRICS, STEP_METRICS
    from core.train import train

    threads = ctx.torch_threads()
    store = TrackingStore(ctx.workdir / "mlflow")
    case = {"batch_size": 32, "epochs": ctx.pick(1, 3), "max_steps": ctx.pick(10, None)}
    case.update(ctx.options.get("case", {}))
    task = make_task(("digits", {"model": "cnn"}))
    cfg = train_config(case)
    repeats = ctx.n_repeats(7)
    naive_repeats = min(repeats, ctx.n_repeats(3))
    warmup = ctx.pick(0, 1)
    ctx.log(f"{NAME}: digits cnn, {case['epochs']} epochs, batch 32, {repeats} rounds "
            f"(naive anchor in {naive_repeats})")

    checks: list[dict] = []
    cpu: dict[str, list[float]] = {"off": [], "batched": [], "naive": []}  # process CPU s per run, same order
    inside: list[float] = []
    create_s: list[float] = []

    def expected_points(result) -> int:
        return result.steps_completed * len(STEP_METRICS) + result.epochs_completed * len(EPOCH_METRICS)

    def off() -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        train(task, cfg, reporter=NullReporter())
        cpu["off"].append(time.process_time() - c0)
        return time.perf_counter() - t0

    def batched() -> float:
        t_c = time.perf_counter()
        reporter, run_ = store.trial_reporter("batched")
        create_s.append(time.perf_counter() - t_c)
        timer = CallTimer(reporter)
        c0, t0 = time.process_time(), time.perf_counter()
        result = train(task, cfg, reporter=timer)
        t_end = time.perf_counter()
        store.tracker.end_run(run_, "FINISHED")
        t1 = time.perf_counter()
        cpu["batched"].append(time.process_time() - c0)
        inside.append(timer.seconds + (t1 - t_end))
        found = store.count_points(run_.run_id)
        checks.append({"arm": "batched", "expected": expected_points(result), "found": sum(found.values()),
                       "per_key": found, "steps": result.steps_completed})
        return t1 - t0

    def naive() -> float:
        client = store.client
        run_ = client.create_run(store.experiment_id, run_name="naive",
                                 tags={"sweeps.role": "trial", "mlflow.parentRunId": store.parent.run_id})
        run_id = run_.info.run_id
        c0, t0 = time.process_time(), time.perf_counter()
        result = train(task, cfg, reporter=NaiveReporter(client, run_id))
        client.set_terminated(run_id, "FINISHED")
        t1 = time.perf_counter()
        cpu["naive"].append(time.process_time() - c0)
        found = store.count_points(run_id)
        checks.append({"arm": "naive", "expected": expected_points(result), "found": sum(found.values()),
                       "steps": result.steps_completed})
        return t1 - t0

    if ctx.quick:  # no warm-up round: pay the first-call costs (imports, allocator) outside the timing
        train(task, train_config({**case, "epochs": 1, "max_steps": 1}), reporter=NullReporter())
    values: dict[str, list[float]] = {"off": [], "batched": [], "naive": []}
    last = 0.0
    for r in range(warmup + repeats):
        if r - warmup >= 1 and not ctx.can_afford(1.1 * last, f"rounds {r - warmup + 1}-{repeats}"):
            break
        t_round = time.monotonic()
        arms = [("off", off), ("batched", batched)]
        if r < warmup + naive_repeats:
            arms.append(("naive", naive))
        for name, fn in arms:
            v = fn()
            if r >= warmup:
                values[name].append(v)
            ctx.log(f"  {'warm-up' if r < warmup else f'round {r - warmup + 1}/{repeats}'} {name}: {v:.3f} s")
        last = time.monotonic() - t_round

    off_t, on_t, naive_t = values["off"], values["batched"], values["naive"]
    overhead = paired_ratio(on_t, off_t, "batched wall / untracked wall (per round)")
    naive_ratio = paired_ratio(naive_t, off_t[:len(naive_t)], "naive wall / untracked wall (per round)")
    naive_vs_batched = paired_ratio(naive_t, on_t[:len(naive_t)], "naive wall / batched wall (per round)")
    inside_batched = inside[warmup:]
    cpu_off, cpu_on = cpu["off"][warmup:], cpu["batched"][warmup:]
    cpu_ratio = paired_ratio(cpu_on, cpu_off, "batched process CPU s / untracked process CPU s (per round)")
    direct = paired_ratio([i + o for i, o in zip(inside_batched, off_t)], off_t,
                          "(untracked wall + time inside tracking calls) / untracked wall")
    batched_checks = [c for c in checks if c["arm"] == "batched"]
    all_recorded = all(c["found"] == c["expected"] for c in batched_checks)
    pct = 100 * (overhead["median"] - 1)
    meets = overhead["median"] - 1 < TARGET_OVERHEAD and all_recorded
    rows = [
        make_row("batched MlflowTracker vs off", metric="wall s of train() + end_run",
                 baseline=arm("tracking off (NullReporter)", off_t),
                 candidate=arm("TrialReporter -> MlflowTracker (SQLite)", on_t), ratio=overhead,
                 target=f"< {1 + TARGET_OVERHEAD:.2f} (overhead < {TARGET_OVERHEAD:.0%}), all points stored",
                 meets_target=meets,
                 headline=f"{pct:+.2f}% wall time (CPU time {100 * (cpu_ratio['median'] - 1):+.2f}%, time inside "
                          f"tracking calls {100 * (direct['median'] - 1):+.2f}%); "
                          f"points stored {batched_checks[-1]['found']}/{batched_checks[-1]['expected']} "
                          f"({'all' if all_recorded else 'MISSING POINTS'} of {len(batched_checks)} runs)",
                 details={"direct_cost_ratio": direct, "cpu_time_ratio": cpu_ratio,
                          "cpu_s": {"off": stats(cpu_off), "batched": stats(cpu_on)},
                          "seconds_inside_tracking_calls": stats(inside_batched),
                          "create_run_s": stats(create_s),
                          "points": batched_checks[-1], "all_runs_complete": all_recorded}),
        make_row("naive per-point log_metric vs off (anchor)", metric="wall s of train() + set_terminated",
                 baseline=arm("tracking off (NullReporter)", off_t[:len(naive_t)]),
                 candidate=arm("MlflowClient.log_metric per point", naive_t), ratio=naive_ratio,
                 headline=f"{100 * (naive_ratio['median'] - 1):+.0f}% wall time; "
                          f"{naive_vs_batched['median']:.2f}x the batched tracker's",
                 details={"naive_vs_batched": naive_vs_batched,
                          "points": [c for c in checks if c["arm"] == "naive"][-1]}),
    ]
    return {
        "target": f"tracking overhead < {TARGET_OVERHEAD:.0%} with every step's points recorded",
        "summary": f"Tracking overhead (batched MLflow vs none, digits CNN): {pct:+.2f}% wall "
                   f"(target < {TARGET_OVERHEAD:.0%}), {'all' if all_recorded else 'NOT all'} points stored; "
                   f"naive per-point log_metric {100 * (naive_ratio['median'] - 1):+.0f}%",
        "rows": rows,
        "notes": [f"torch threads: {threads} (see README: Load). Two more estimates next to the wall-time ratio: "
                  "process CPU time (insensitive to other processes, blind to I/O waits such as SQLite's fsync) "
                  "and the wall time spent inside the reporter's calls and end_run (direct cost).",
                  f"Workload: digits CNN, batch 32, {case['epochs']} epoch(s), "
                  f"{batched_checks[-1]['steps']} optimizer steps, {len(STEP_METRICS)} metrics per step and "
                  f"{len(EPOCH_METRICS)} per epoch; validation runs in every arm.",
                  "The batched tracker flushes once per epoch (TrialReporter.report_epoch) and at end_run; "
                  "its buffer also flushes every 2,000 points or 5 s."],
        "details": {"checks": checks},
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(NAME, TITLE, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
