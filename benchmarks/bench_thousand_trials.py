"""A study of thousands of trials: ``sweeps run`` of N one-step trials of the synthetic task on 2
workers (TPE), then ``sweeps status`` and ``sweeps report`` on it and a listing of its runs.

Figures: orchestration per trial at the end of the study against its start (the median gap
between consecutive trial ends, minus the trials' own time, over the last tenth of trials
against the first tenth: TPE's ask grows with the history); ``sweeps status`` wall time (target
under 5 s); ``sweeps report`` wall time and peak memory (targets under 60 s and 1 GB); the MLflow
store's size per trial; the time to list the study's trial runs with ``MlflowClient``.
Its size is a parameter: ``--opt n_trials=2000`` (the default full size).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Context, error_row, make_row
from benchmarks.sweeps_runs import mlflow_trials, run_sweeps, sweeps_env, tiny_spec, write_spec

NAME = "thousand_trials"
TITLE = "A study of thousands of one-step trials: orchestration at its end vs start, status, report, store"
END_OVER_START, STATUS_S, REPORT_S, REPORT_MB = 1.5, 5.0, 60.0, 1024.0

# Runs a sweeps command in a child process and prints its wall time and the peak RSS (MB) of the
# largest process it waited for: the command's own memory, not this wrapper's.
_TIMED = ("import json, resource, subprocess, sys, time\n"
          "t0 = time.perf_counter(); rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
          "print(json.dumps({'rc': rc, 'wall_s': time.perf_counter() - t0,\n"
          "                  'peak_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))")


def timed_command(cwd: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _TIMED, sys.executable, "-m", "sweeps.cli", *args], cwd=cwd,
                          env=sweeps_env(), capture_output=True, text=True, timeout=900)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def orchestration(trials: list[dict], workers: int) -> dict:
    """Per-trial orchestration over the first and the last tenth of the trials: the gap between
    consecutive trial ends (the study's pace, ``workers`` trials at a time) times ``workers``,
    minus a trial's own time."""
    ends = sorted(trials, key=lambda t: t["end_s"])
    tenth = max(len(ends) // 10, 2)

    def per_trial(part: list[dict], before: dict) -> float:
        gaps = [b["end_s"] - a["end_s"] for a, b in zip([before, *part[:-1]], part, strict=True)]
        return statistics.median(gaps) * workers - statistics.median(t["trial_seconds"] for t in part)

    start = per_trial(ends[1:tenth + 1], ends[0])
    end = per_trial(ends[-tenth:], ends[-tenth - 1])
    return {"start_s": start, "end_s": end, "end_over_start": end / start if start > 0 else None,
            "trials_per_tenth": tenth}


def listing_seconds(folder: Path, experiment: str) -> tuple[float, int]:
    """Seconds to list every trial run of the study with ``MlflowClient`` (pages of 1,000)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder}/runs/mlflow.db")
    t0 = time.perf_counter()
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], filter_string="tags.`sweeps.role` = 'trial'",
                                  max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            break
    return time.perf_counter() - t0, len(runs)


def run(ctx: Context) -> dict:
    n = int(ctx.options.get("n_trials", ctx.pick(20, 2000)))
    workers = 2
    folder = ctx.workdir / "study"
    spec = tiny_spec(NAME, task={"name": "synthetic", "model": "mlp", "args": {"shape": [16], "n_train": 64,
                                                                              "n_val": 32, "num_classes": 4}},
                     train={"epochs": 1, "batch_size": 64, "max_steps_per_epoch": 1, "save_checkpoints": False},
                     sampler={"name": "tpe", "seed": 0}, budget={"n_trials": n, "max_failures": 3},
                     resources={"devices": "cpu", "workers": workers})
    spec["storage"] = f"runs/{NAME}.journal"
    ctx.log(f"{NAME}: sweeps run of {n} one-step trials on {workers} workers")
    res = run_sweeps(folder, write_spec(folder, spec), ctx.pick(600, 7200))
    trials = [t for t in mlflow_trials(folder, NAME) if t["trial_seconds"] is not None]
    if res["rc"] != 0 or len(trials) < n:
        return {"summary": "the study did not finish", "rows": [error_row(
            f"{n} trials: sweeps run", f"exited {res['rc']} with {len(trials)} of {n} trials; log tail:\n"
            f"{res['log_tail'][-1500:]}")]}
    spec_path = str(folder / f"{NAME}.yaml")
    ctx.log(f"{NAME}: sweeps status, sweeps report, listing the runs")
    status = timed_command(folder, "status", spec_path)
    report = timed_command(folder, "report", spec_path)
    list_s, listed = listing_seconds(folder, NAME)
    # The MLflow store: its database and every artifact file it holds.
    store_bytes = (folder / "runs" / "mlflow.db").stat().st_size + sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and "mlartifacts" in p.parts)
    pace = orchestration(trials, workers)
    rows = [
        make_row(f"{n} trials: orchestration per trial, end vs start", metric="seconds per trial",
                 target=f"end <= {END_OVER_START}x start",
                 meets_target=pace["end_over_start"] is not None and pace["end_over_start"] <= END_OVER_START,
                 headline=f"start {pace['start_s']:.3f} s, end {pace['end_s']:.3f} s "
                          f"({pace['end_over_start'] or float('nan'):.2f}x); whole study {res['wall_s']:.0f} s",
                 details={**pace, "wall_s": res["wall_s"]}),
        make_row(f"{n} trials: sweeps status", metric="seconds", target=f"< {STATUS_S} s",
                 meets_target=status["rc"] == 0 and status["wall_s"] < STATUS_S,
                 headline=f"{status['wall_s']:.1f} s (exit {status['rc']})", details=status),
        make_row(f"{n} trials: sweeps report", metric="seconds and peak MB",
                 target=f"< {REPORT_S} s and < {REPORT_MB:.0f} MB",
                 meets_target=report["rc"] == 0 and report["wall_s"] < REPORT_S and report["peak_mb"] < REPORT_MB,
                 headline=f"{report['wall_s']:.1f} s, peak {report['peak_mb']:.0f} MB (exit {report['rc']})",
                 details=report),
        make_row(f"{n} trials: MLflow store", metric="KB per trial, seconds to list",
                 headline=f"{store_bytes / n / 1024:.1f} KB per trial; listing {listed} trial runs took {list_s:.2f} s",
                 details={"store_bytes": store_bytes, "list_s": list_s, "listed": listed}),
    ]
    return {"target": f"orchestration at the end <= {END_OVER_START}x its start, status < {STATUS_S:.0f} s, "
                      f"report < {REPORT_S:.0f} s and {REPORT_MB:.0f} MB (issue 41)",
            "summary": "; ".join(r["headline"] for r in rows), "rows": rows,
            "notes": [f"{n} trials of the synthetic MLP (16 features), one optimizer step each, no checkpoints or "
                      f"ONNX; TPE, {workers} workers, Optuna on a journal file, MLflow on SQLite."]}
