"""Orchestration overhead per trial: ``sweeps run`` of a study of short trials, 1 worker.

overhead per trial = (wall time of ``sweeps run`` - sum of the trials' own time) / trials,
where a trial's own time is its MLflow ``trial_seconds`` metric (``run_trial`` start to end:
the trial's MLflow run set-up, ``core.train()``, and the final metrics/tags). The wall time is
split into:

* start-up: the CLI launched -> the first trial's MLflow run created (interpreter and imports,
  spec, MLflow store, study and parent run, the worker process and its imports);
* between trials: what the worker does around each trial (ask/tell, the parent run's best-so-far);
* shut-down: the last trial ended -> the CLI exited (summary, parent run closed).

Measured for the Optuna backend and the Ray backend (a Ray failure is recorded, not raised).
Also measured alone: a fresh interpreter importing what a worker imports.
"""
from __future__ import annotations

import statistics

from benchmarks.common import Context, arm, error_row, make_row, paired_ratio, stats
from benchmarks.sweeps_runs import mlflow_trials, python_start_s, run_sweeps, tiny_spec, write_spec

NAME = "orchestration"
TITLE = "Orchestration overhead per trial: sweeps run, 1 worker, short digits trials (Optuna, Ray)"
TARGET_S = 0.3

# What a worker imports before its first digits trial: the worker's own preloads (TRIAL_IMPORTS:
# torch, torchmetrics, MLflow's SQL store, the trainer, onnx, onnxruntime) and the task module,
# whose split comes from its cache (core/tasks/digits.py) once any run has made it.
WORKER_IMPORTS = ("import importlib, sweeps.trial, core.tasks.digits\n"
                  "from sweeps.backends.optuna_worker import TRIAL_IMPORTS\n"
                  "for module in TRIAL_IMPORTS:\n"
                  "    importlib.import_module(module)")


def one_study(ctx: Context, backend: str, n_trials: int, index: int, timeout_s: float) -> dict:
    name = f"orch_{backend}"
    folder = ctx.workdir / f"{backend}-{index}"
    spec = tiny_spec(name, backend=backend, budget={"n_trials": n_trials, "max_failures": 3})
    if backend == "ray":
        spec["resources"]["cpus_per_trial"] = 1
    res = run_sweeps(folder, write_spec(folder, spec), timeout_s)
    trials = mlflow_trials(folder, name)
    done = [t for t in trials if t["state"] in ("COMPLETE", "PRUNED") and t["trial_seconds"] is not None]
    out = {"rc": res["rc"], "timed_out": res["timed_out"], "wall_s": res["wall_s"], "n_trials": len(done),
           "log_tail": res["log_tail"][-1500:]}
    if res["rc"] != 0 or len(done) < n_trials:
        out["error"] = (f"sweeps run exited {res['rc']}{' (timed out)' if res['timed_out'] else ''} with "
                        f"{len(done)}/{n_trials} finished trials; log tail:\n{res['log_tail'][-1200:]}")
        return out
    sum_trial = sum(t["trial_seconds"] for t in done)
    first_start = min(t["start_s"] for t in done)
    last_end = max(t["end_s"] for t in done)
    n = len(done)
    out.update(
        sum_trial_s=sum_trial,
        per_trial_overhead_s=(res["wall_s"] - sum_trial) / n,
        startup_s=first_start - res["t_start"],
        shutdown_s=res["t_end"] - last_end,
        between_trials_s=(last_end - first_start - sum_trial) / max(n - 1, 1),
        trial_seconds=stats(t["trial_seconds"] for t in done),
        first_trial_s=done[0]["trial_seconds"],
        # The first trial also pays the worker's lazy imports and first MLflow calls: a start-up cost.
        first_trial_extra_s=done[0]["trial_seconds"] - statistics.median(t["trial_seconds"] for t in done[1:])
        if n > 1 else 0.0,
        trial_fraction=sum_trial / res["wall_s"],
    )
    return out


def run(ctx: Context) -> dict:
    n_trials = int(ctx.options.get("n_trials", ctx.pick(3, 30)))
    repeats = {"optuna": ctx.n_repeats(2), "ray": ctx.n_repeats(1)}
    timeout_s = ctx.pick(240, 480)
    ctx.log(f"{NAME}: worker start-up (fresh interpreter + imports)")
    imports_s = python_start_s(WORKER_IMPORTS, repeats=1)  # a side figure: its 8 s go to a second study run
    rows, runs = [], {}
    backends = ctx.options.get("backends", ("optuna", "ray"))
    # Alternate backends (optuna, ray, optuna, ...) so drift hits both.
    order = []
    for r in range(max(repeats.values())):
        order += [b for b in backends if r < repeats[b]]
    for i, backend in enumerate(order):
        before = [r["wall_s"] for r in runs.get(backend, []) if "wall_s" in r]
        if before and not ctx.can_afford(1.1 * max(before), f"{backend} run {len(before) + 1}"):
            continue
        ctx.log(f"{NAME}: {backend} study of {n_trials} trials (run {i + 1}/{len(order)})")
        try:
            out = one_study(ctx, backend, n_trials, i, timeout_s)
        except Exception as exc:  # noqa: BLE001 - record and go on
            out = {"error": f"{type(exc).__name__}: {exc}"}
        runs.setdefault(backend, []).append(out)
        ctx.log(f"  {backend}: " + (out["error"].splitlines()[0] if "error" in out else
                                    f"wall {out['wall_s']:.1f} s, trials {out['sum_trial_s']:.1f} s, "
                                    f"overhead {out['per_trial_overhead_s']:.3f} s/trial, "
                                    f"start-up {out['startup_s']:.1f} s"))

    for backend in backends:
        good = [r for r in runs.get(backend, []) if "error" not in r]
        if not good:
            err = next((r["error"] for r in runs.get(backend, []) if "error" in r), "not run")
            rows.append(error_row(f"{backend}: overhead per trial", err,
                                  target=f"<= {TARGET_S} s" if backend == "optuna" else None,
                                  details={"runs": runs.get(backend, [])}))
            continue
        per = [r["per_trial_overhead_s"] for r in good]
        med = statistics.median(per)
        target = f"<= {TARGET_S} s per trial" if backend == "optuna" else None
        rows.append(make_row(
            f"{backend}: overhead per trial", metric="seconds",
            baseline=arm("sum of trial_seconds", [r["sum_trial_s"] for r in good]),
            candidate=arm("wall of sweeps run", [r["wall_s"] for r in good]),
            ratio=paired_ratio([r["sum_trial_s"] for r in good], [r["wall_s"] for r in good],
                               "sum of trials' own time / wall (share of the wall spent in trials)"),
            target=target, meets_target=(med <= TARGET_S) if target else None,
            headline=f"{med:.3f} s/trial over {good[0]['n_trials']} trials "
                     f"(start-up {statistics.median(r['startup_s'] for r in good):.1f} s "
                     f"+ {statistics.median(r['first_trial_extra_s'] for r in good):.1f} s extra in the first trial, "
                     f"between trials {statistics.median(r['between_trials_s'] for r in good):.3f} s, "
                     f"shut-down {statistics.median(r['shutdown_s'] for r in good):.1f} s)",
            details={"per_trial_overhead_s": stats(per),
                     "startup_s": stats(r["startup_s"] for r in good),
                     "between_trials_s": stats(r["between_trials_s"] for r in good),
                     "shutdown_s": stats(r["shutdown_s"] for r in good),
                     "first_trial_extra_s": stats(r["first_trial_extra_s"] for r in good),
                     "per_trial_overhead_excluding_startup_shutdown_s":
                         stats((r["wall_s"] - r["startup_s"] - r["shutdown_s"] - r["sum_trial_s"]) / r["n_trials"]
                               for r in good),
                     "runs": runs[backend]}))
    rows.append(make_row("worker process start + imports", metric="seconds",
                         headline=f"{imports_s:.2f} s for a fresh interpreter importing what a worker imports",
                         details={"imports": WORKER_IMPORTS, "seconds": imports_s}))
    bits = []
    for r in rows[:-1]:
        bits.append(f"{r['case'].split(':')[0]} " + (r["headline"].split(" over")[0] if r["status"] == "ok"
                                                      else "failed"))
    return {
        "target": f"<= {TARGET_S} s orchestration overhead per trial with Optuna",
        "summary": f"Orchestration overhead per trial ({n_trials}-trial study, 1 worker): " + "; ".join(bits)
                   + f" (target <= {TARGET_S} s with Optuna); worker start + imports {imports_s:.1f} s",
        "rows": rows,
        "notes": ["Trials: digits MLP (width 32), 1 epoch at batch 128 (12 steps), no checkpoints, no ONNX; "
                  "random sampler, no pruner; MLflow on SQLite, Optuna on a journal file (the embedded default).",
                  "A trial's own time (trial_seconds) includes creating its MLflow run, its params and the "
                  "resolved-config artifact, so per-trial MLflow set-up counts as trial time here.",
                  "overhead per trial = (wall - sum of trial_seconds) / trials, start-up and shut-down included; "
                  "the row details also give it without them."],
        "details": {"runs": runs, "worker_imports_s": imports_s},
    }

