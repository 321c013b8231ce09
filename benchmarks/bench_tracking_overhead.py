"""Tracking overhead: the same ``core.train()`` run with MLflow tracking on and off.

* off: ``NullReporter`` (what a plain ``train()`` call does);
* tracked (the product, as Optuna workers and Ray trials run it): ``sweeps.trial.TrialReporter``
  on an ``MlflowTracker`` in the trainer's process, the one tracking path: per-step points are
  buffered and written to the SQLite store by the trainer every 2,000 points / 5 s and at
  ``end_run``, which returns once the run's last points and its status are in the store;
* naive (the anchor): a reporter that sends every point at once with ``MlflowClient.log_metric``,
  one store round trip per point, as a fluent-API loop would.

The target's measure is lockstep (``benchmarks/hand_loop.py``): runs alternate tracking off
and on, and in each, after every one of core's steps, a hand-written loop takes one timed step
of its own. Each run's cost is core's step time (its reporter's calls included) plus, for the
tracked run, its epoch reports and ``end_run``, over the hand steps' time beside it; the
overhead is the tracked run's cost over the untracked one's, pair by pair. The hand steps are a
yardstick taken milliseconds from each core step, so the VM's drift in speed (10-15% within
seconds, more than the 2% to resolve) cancels. Whole runs are timed too, as a cross-check:
the ``train()`` call plus the run's ``end_run`` / ``set_terminated``. Creating the run is
per-trial set-up, timed separately. Rounds alternate the arms' order (AB, BA, ...); each
ratio is taken inside one round. After each tracked run the store is read back: every step's
points must be there. Also reported: the time spent inside the reporter's calls.

(Until the code-health work the product wrote from a child process, a "writer", or a thread of
``sweeps run``, with the in-process tracker measured beside it; those modes were removed for
simplicity: benchmarks/README.md.)
"""
from __future__ import annotations

import time

from benchmarks.common import Context, arm, make_row, paired_ratio, stats
from benchmarks.hand_loop import HandStepper, Lockstep

NAME = "tracking_overhead"
TITLE = "Tracking overhead: core.train() with batched MLflow tracking vs none vs per-point log_metric"
TARGET_OVERHEAD = 0.02
ARMS = ("off", "tracked", "naive")


class CallTimer:
    """Wraps a reporter and adds up the wall time spent inside its calls, in all (``seconds``)
    and per method (``by_method``)."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0
        self.by_method: dict[str, float] = {"report_step": 0.0, "report_epoch": 0.0, "log_artifact": 0.0}

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent = time.perf_counter() - t0
            self.seconds += spent
            self.by_method[fn.__name__] += spent
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


def lockstep_pairs(task, cfg, store, pairs: int, ctx: Context) -> dict:
    """Untracked and tracked runs in turn, each in lockstep with a hand loop; per pair,
    the tracked run's cost over the untracked one's (see the module docstring)."""
    from core.reporting import NullReporter
    from core.train import train

    costs: dict[str, list[float]] = {"off": [], "tracked": []}
    points: list[dict] = []
    per_step_us: dict[str, list[float]] = {"off": [], "tracked": []}
    t0 = time.monotonic()
    for r in range(pairs):
        per_pair = (time.monotonic() - t0) / max(r, 1)
        if r >= 1 and not ctx.can_afford(1.1 * per_pair, f"lockstep pairs {r + 1}-{pairs}"):
            break
        for arm_name in ("off", "tracked"):
            reporter, run_ = (store.trial_reporter(f"lockstep-{r}") if arm_name == "tracked"
                              else (NullReporter(), None))
            timer = CallTimer(reporter)  # its report_epoch time (the epoch-end flush): Lockstep leaves it out
            pace = Lockstep(timer, HandStepper(task, cfg))
            result = train(task, cfg, reporter=pace)
            t_end = time.perf_counter()
            if run_ is not None:
                store.tracker.end_run(run_, "FINISHED")
            end_s = time.perf_counter() - t_end
            if run_ is not None:
                found = sum(store.count_points(run_.run_id).values())
                points.append({"expected": expected_points(result), "found": found})
            core = sum(pace.core_s) + timer.by_method["report_epoch"] + end_s
            costs[arm_name].append(core / sum(pace.hand_s))
            per_step_us[arm_name].append(1e6 * sum(pace.core_s) / len(pace.core_s))
        ctx.log(f"  lockstep pair {r + 1}/{pairs}: tracked/untracked "
                f"{costs['tracked'][-1] / costs['off'][-1]:.4f}")
    ratio = paired_ratio(costs["tracked"], costs["off"], "per pair: (core step time + epoch reports + end_run) "
                         "over the hand steps beside it, tracked run / untracked run")
    return {"ratio": ratio, "costs": costs, "core_step_us": {k: stats(v) for k, v in per_step_us.items()},
            "step_pairs_per_run": len(pace.core_s), "points": points,
            "all_runs_complete": all(c["found"] == c["expected"] for c in points)}


def expected_points(result) -> int:
    """The points a tracked run must have stored: every step's and every epoch's metrics."""
    from core.results import STEP_METRICS

    epoch_points = sum(len(row) - 2 for row in result.history)  # each row: epoch, step and the metrics
    return result.steps_completed * len(STEP_METRICS) + epoch_points


def lockstep_row(paced: dict) -> dict:
    """The target's row: tracked over untracked cost, each against the hand steps beside it."""
    ratio, complete = paced["ratio"], paced["all_runs_complete"]
    last = paced["points"][-1] if paced["points"] else {"found": 0, "expected": 0}
    return make_row(
        "tracked vs off, lockstep", metric="(core step time + epoch reports + end_run) / hand step time",
        baseline={"label": "tracking off (NullReporter), core step us", **paced["core_step_us"]["off"]},
        candidate={"label": "TrialReporter -> MlflowTracker, core step us", **paced["core_step_us"]["tracked"]},
        ratio=ratio, target=f"< {1 + TARGET_OVERHEAD:.2f} (overhead < {TARGET_OVERHEAD:.0%}), all points stored",
        meets_target=ratio["median"] - 1 < TARGET_OVERHEAD and complete,
        headline=f"{100 * (ratio['median'] - 1):+.2f}% ({ratio['n']} pairs of runs, {paced['step_pairs_per_run']} "
                 f"step pairs each, end_run and epoch reports included); points stored {last['found']}/"
                 f"{last['expected']} ({'all' if complete else 'MISSING POINTS'} of {len(paced['points'])} runs)",
        details=paced)


def run(ctx: Context) -> dict:
    from benchmarks.bench_trainer_overhead import make_task, train_config
    from benchmarks.sweeps_runs import TrackingStore
    from core.reporting import NullReporter
    from core.results import STEP_METRICS
    from core.train import train

    threads = ctx.torch_threads()
    store = ctx.closing(TrackingStore(ctx.workdir / "mlflow"))
    # A trial of studies/lr_bs.yaml (the main study): 8 epochs of the digits CNN, here at batch 32.
    case = {"batch_size": 32, "epochs": ctx.pick(1, 8), "max_steps": ctx.pick(10, None)}
    case.update(ctx.options.get("case", {}))
    task = make_task(("digits", {"model": "cnn"}))
    cfg = train_config(case)
    repeats = ctx.n_repeats(5)
    naive_repeats = min(repeats, ctx.n_repeats(3))
    # Pay the first-call costs (imports, allocator, a first run in the store) outside the timing.
    train(task, train_config({**case, "epochs": 1, "max_steps": 2}), reporter=NullReporter())
    reporter, run_ = store.trial_reporter("warm-up")
    train(task, train_config({**case, "epochs": 1, "max_steps": 2}), reporter=reporter)
    store.tracker.end_run(run_, "FINISHED")
    ctx.log(f"{NAME}: lockstep, tracking off and on in turn, each beside a hand loop")
    paced = lockstep_pairs(task, cfg, store, ctx.n_repeats(5), ctx)
    ctx.keep([lockstep_row(paced)])
    warmup = ctx.pick(0, 1)
    ctx.log(f"{NAME}: digits cnn, {case['epochs']} epochs, batch 32, {repeats} rounds "
            f"(naive anchor in {naive_repeats})")

    checks: list[dict] = []
    cpu: dict[str, list[float]] = {arm_: [] for arm_ in ARMS}  # process CPU s per run, same order
    inside: list[float] = []
    create_s: list[float] = []
    end_s: list[float] = []

    def off() -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        train(task, cfg, reporter=NullReporter())
        cpu["off"].append(time.process_time() - c0)
        return time.perf_counter() - t0

    def tracked() -> float:
        t_c = time.perf_counter()
        reporter, run_ = store.trial_reporter("tracked")
        create_s.append(time.perf_counter() - t_c)
        timer = CallTimer(reporter)
        c0, t0 = time.process_time(), time.perf_counter()
        result = train(task, cfg, reporter=timer)
        t_end = time.perf_counter()
        store.tracker.end_run(run_, "FINISHED")
        t1 = time.perf_counter()
        cpu["tracked"].append(time.process_time() - c0)
        inside.append(timer.seconds + (t1 - t_end))
        end_s.append(t1 - t_end)
        found = store.count_points(run_.run_id)
        checks.append({"arm": "tracked", "expected": expected_points(result), "found": sum(found.values()),
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

    values: dict[str, list[float]] = {arm_: [] for arm_ in ARMS}
    last = 0.0
    for r in range(warmup + repeats):
        if r - warmup >= 1 and not ctx.can_afford(1.1 * last, f"rounds {r - warmup + 1}-{repeats}"):
            break
        t_round = time.monotonic()
        arms = [("off", off), ("tracked", tracked)]
        if (r - warmup) % 2:  # AB BA ...: an arm's place in the round (what ran before it) alternates
            arms.reverse()
        if warmup <= r < warmup + naive_repeats:  # 16 s a run: no warm-up run of its own
            arms.append(("naive", naive))
        for name, fn in arms:
            v = fn()
            if r >= warmup:
                values[name].append(v)
            ctx.log(f"  {'warm-up' if r < warmup else f'round {r - warmup + 1}/{repeats}'} {name}: {v:.3f} s")
        last = time.monotonic() - t_round

    off_t, on_t, naive_t = values["off"], values["tracked"], values["naive"]
    naive_ratio = paired_ratio(naive_t, off_t[:len(naive_t)], "naive wall / untracked wall (per round)")
    naive_vs_tracked = paired_ratio(naive_t, on_t[:len(naive_t)], "naive wall / tracked wall (per round)")
    overhead = paired_ratio(on_t, off_t, "tracked wall / untracked wall (per round)")
    cpu_ratio = paired_ratio(cpu["tracked"][warmup:], cpu["off"][warmup:],
                             "tracked trainer-process CPU s / untracked CPU s (per round)")
    direct = paired_ratio([i + o for i, o in zip(inside[warmup:], off_t, strict=True)], off_t,
                          "(untracked wall + time inside tracking calls) / untracked wall")
    mine = [c for c in checks if c["arm"] == "tracked"]
    complete = all(c["found"] == c["expected"] for c in mine)
    end_ms = stats(1e3 * v for v in end_s[warmup:])
    whole = make_row(
        "tracked vs off, whole runs", metric="wall s of train() + end_run",
        baseline=arm("tracking off (NullReporter)", off_t),
        candidate=arm("TrialReporter -> MlflowTracker (SQLite, written by the trainer)", on_t), ratio=overhead,
        headline=f"{100 * (overhead['median'] - 1):+.2f}% wall time (trainer CPU time "
                 f"{100 * (cpu_ratio['median'] - 1):+.2f}%, time inside tracking calls "
                 f"{100 * (direct['median'] - 1):+.2f}%, of which end_run {end_ms['median']:.1f} ms); points stored "
                 f"{mine[-1]['found']}/{mine[-1]['expected']} ({'all' if complete else 'MISSING POINTS'} of "
                 f"{len(mine)} runs)",
        details={"direct_cost_ratio": direct, "cpu_time_ratio": cpu_ratio, "end_run_ms": end_ms,
                 "cpu_s": {"off": stats(cpu["off"][warmup:]), "tracked": stats(cpu["tracked"][warmup:])},
                 "seconds_inside_tracking_calls": stats(inside[warmup:]), "points": mine[-1],
                 "all_runs_complete": complete})
    rows = [
        lockstep_row(paced),
        whole,
        make_row("naive per-point log_metric vs off (anchor)", metric="wall s of train() + set_terminated",
                 baseline=arm("tracking off (NullReporter)", off_t[:len(naive_t)]),
                 candidate=arm("MlflowClient.log_metric per point", naive_t), ratio=naive_ratio,
                 headline=f"{100 * (naive_ratio['median'] - 1):+.0f}% wall time; "
                          f"{naive_vs_tracked['median']:.2f}x the tracker's",
                 details={"naive_vs_tracked": naive_vs_tracked,
                          "points": [c for c in checks if c["arm"] == "naive"][-1]}),
    ]
    pct = 100 * (rows[0]["ratio"]["median"] - 1)
    all_recorded = rows[0]["details"]["all_runs_complete"] and complete
    return {
        "target": f"tracking overhead < {TARGET_OVERHEAD:.0%} with every step's points recorded",
        "summary": f"Tracking overhead (MLflow written by the trainer vs none, digits CNN): {pct:+.2f}% in lockstep "
                   f"(target < {TARGET_OVERHEAD:.0%}), {'all' if all_recorded else 'NOT all'} points stored; whole "
                   f"runs {100 * (overhead['median'] - 1):+.2f}% wall (cross-check); "
                   f"naive per-point log_metric {100 * (naive_ratio['median'] - 1):+.0f}%",
        "rows": rows,
        "notes": [f"torch threads: {threads} (see README: Load). Two more estimates next to the wall-time ratio: "
                  "the trainer process's CPU time (insensitive to other processes, blind to I/O waits such as "
                  "SQLite's fsync) and the wall time spent inside the reporter's calls and end_run (direct cost).",
                  f"Workload: a trial of studies/lr_bs.yaml: digits CNN, batch 32, {case['epochs']} epoch(s), "
                  f"{checks[-1]['steps']} optimizer steps, {len(STEP_METRICS)} metrics per step and "
                  "the loop's and the task's metrics per epoch; validation runs in every arm.",
                  f"Creating a run (start_run, tags) is per-trial set-up, outside the timing: "
                  f"{stats(1e3 * v for v in create_s)['median']:.0f} ms median. end_run is inside it: it returns "
                  "once the run's last points and its status are in the store.",
                  "The tracker writes from the trainer's process: its store writes (about 0.1 ms of SQLite ORM CPU "
                  "per point) are part of the trainer's time, on every machine."],
        "details": {"checks": checks},
    }

