"""Benchmarks that run the real thing: the ``sweeps`` CLI on a spec in a scratch folder (and
what it stored: MLflow trial runs, the Optuna study), and a SQLite MLflow store with the
trackers a worker trains with (:class:`TrackingStore`).
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT


def sweeps_env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no prompts nor phoning home from the Ray backend
    return env


def tiny_spec(name: str, **overrides: Any) -> dict:
    """The tests' tiny digits-MLP study (tests/sweeps/study_helpers.py), one epoch per
    trial and no checkpoints: well under a second of training per trial on 2 cores."""
    from tests.sweeps.study_helpers import tiny_spec as test_study
    from tests.sweeps.study_helpers import with_overrides

    spec = test_study(name, description="benchmark study", train={"epochs": 1, "save_checkpoints": False})
    return with_overrides(spec, **overrides)


def write_spec(folder: Path, spec: dict) -> Path:
    """The spec as ``folder/<name>.yaml``; the MLflow store is left to the run to create."""
    from tests.sweeps.study_helpers import save_spec

    return save_spec(folder, spec, seed_store=False)


def run_sweeps(cwd: Path, spec_path: Path, timeout_s: float, cpus: Sequence[int] | None = None,
               env: dict | None = None) -> dict:
    """``sweeps run SPEC --quiet`` in ``cwd`` (its runs/ lands there); wall time and exit code.
    ``cpus`` pins the whole process tree to those CPUs (sched_setaffinity before exec); ``env``
    replaces :func:`sweeps_env`."""
    return wait_sweeps(start_sweeps(cwd, spec_path, cpus, env), timeout_s)


def start_sweeps(cwd: Path, spec_path: Path, cpus: Sequence[int] | None = None, env: dict | None = None) -> dict:
    cwd.mkdir(parents=True, exist_ok=True)
    log_path = cwd / f"{spec_path.stem}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed in wait_sweeps
    preexec = (lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None
    t_wall = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sweeps.cli", "run", str(spec_path), "--quiet"], cwd=cwd,
                            env=env or sweeps_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=preexec)
    return {"proc": proc, "log": log, "log_path": log_path, "t_start": t_wall, "t0": t0}


def wait_sweeps(handle: dict, timeout_s: float) -> dict:
    proc: subprocess.Popen = handle["proc"]
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop_group(proc)
        rc = proc.returncode
    wall = time.perf_counter() - handle["t0"]
    handle["log"].close()
    text = handle["log_path"].read_text(errors="replace")
    return {"rc": rc, "timed_out": timed_out, "wall_s": wall, "t_start": handle["t_start"],
            "t_end": handle["t_start"] + wall, "log_tail": text[-3000:], "log_path": str(handle["log_path"])}


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the CLI's process group (workers checkpoint and stop), then SIGKILL after 30 s."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def mlflow_trials(cwd: Path, experiment: str) -> list[dict]:
    """The trial runs of ``experiment`` in ``cwd/runs/mlflow.db``: state, times, trial_seconds."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd}/runs/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`sweeps.role` = 'trial'",
                              max_results=5000)
    out = []
    for r in runs:
        out.append({"number": int(r.data.tags.get("sweeps.trial_number", -1)),
                    "state": r.data.tags.get("sweeps.state"), "status": r.info.status,
                    "start_s": r.info.start_time / 1000.0,
                    "end_s": (r.info.end_time or r.info.start_time) / 1000.0,
                    "trial_seconds": r.data.metrics.get("trial_seconds"),
                    "worker": r.data.tags.get("sweeps.worker"), "run_id": r.info.run_id})
    return sorted(out, key=lambda t: t["start_s"])


def optuna_study(cwd: Path, spec_name: str):
    """The (single) Optuna study of a spec run in ``cwd`` with the default journal storage."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(cwd / "runs" / f"{spec_name}.journal")))
    names = optuna.study.get_all_study_names(storage)
    name = spec_name if spec_name in names else names[-1]
    return optuna.load_study(study_name=name, storage=storage)


def python_start_s(code: str, repeats: int = 1) -> float:
    """Median wall time of ``python -c code`` in a fresh interpreter (process start + imports)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=sweeps_env(), check=True, capture_output=True, timeout=300)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- in-process tracking


class TrackingStore:
    """A SQLite MLflow store in ``folder`` with a study parent run, and ``tracker``: the
    :class:`sweeps.tracking.mlflow_tracker.MlflowTracker` a worker trains with (in the trainer's
    process, the one tracking path). Hands out :class:`sweeps.trial_reporter.TrialReporter` objects
    wired the way an Optuna worker wires them (never prunes, never interrupted, heartbeat
    touches a file)."""

    def __init__(self, folder: Path, experiment: str = "bench") -> None:
        from sweeps.tracking import MlflowTracker, TrackingReader

        folder.mkdir(parents=True, exist_ok=True)
        self.uri = f"sqlite:///{folder / 'mlflow.db'}"
        self.tracker = MlflowTracker(self.uri, spool_dir=folder / "spool", artifact_root=folder / "artifacts")
        self.tracker.check_connection()
        self.parent = self.tracker.start_run("bench-study", experiment=experiment, tags={"sweeps.role": "study"})
        self.experiment_id = self.parent.experiment_id
        self.reader = TrackingReader(self.uri)
        self.beat_file = folder / "worker.beat"
        self.beat_file.touch()

    @property
    def client(self):
        """A bare MlflowClient on the store, for the naive per-point anchor (not how sweeps writes)."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def trial_reporter(self, name: str, objective: str = "val_acc"):
        """A new child run and its TrialReporter: ``(reporter, run)``."""
        from sweeps.trial_control import TrialControl
        from sweeps.trial_reporter import TrialReporter

        run = self.tracker.start_run(name, parent=self.parent, tags={"sweeps.role": "trial"})
        reporter = TrialReporter(self.tracker, run, objective, TrialControl(heartbeat=self.beat_file.touch))
        return reporter, run

    def close(self) -> None:
        """Send whatever is still buffered."""
        self.tracker.close()

    def count_points(self, run_id: str) -> dict[str, int]:
        """Points stored per metric key (every point, not just the latest)."""
        self.tracker.flush()
        keys = self.reader.get_run(run_id).data.metrics.keys()
        return {k: len(self.reader.metric_history(run_id, k)) for k in sorted(keys)}
