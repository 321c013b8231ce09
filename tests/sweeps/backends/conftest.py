"""Shared pieces of the backend tests: tiny study specs, the real `sweeps` CLI in a
subprocess, MLflow read-back, and Ray hygiene (every Ray process a test starts is found
by its private temp folder and killed by pid afterwards; nothing else is touched)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def write_spec(folder: Path, name: str = "tiny", backend: str = "optuna", **overrides) -> Path:
    """A digits-MLP study: a second or two per trial on one CPU thread."""
    spec = {
        "name": name,
        "description": "tiny backend test study",
        "task": {"name": "digits", "model": "mlp", "args": {"width": 32}},
        "train": {"epochs": 2, "batch_size": 64, "optimizer": "sgd", "scheduler": "constant",
                  "num_workers": 0, "export_onnx": False, "seed": 0},
        "search": {"lr": {"type": "float", "low": 0.01, "high": 0.5, "log": True}},
        "objective": {"metric": "val_acc", "direction": "maximize"},
        "backend": backend,
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "none"},
        "budget": {"n_trials": 3, "max_failures": 1},
        "resources": {"devices": "cpu", "workers": 1},
        "tracking": {"uri": "sqlite:///runs/mlflow.db"},
    }
    for key, value in overrides.items():  # sections are merged, except `search`, which is replaced
        if isinstance(value, dict) and isinstance(spec.get(key), dict) and key != "search":
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    db = folder / "runs" / "mlflow.db"
    if _TEMPLATE_DB and not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_TEMPLATE_DB[0], db)  # the empty schema: saves each run the migrations
    return path


_TEMPLATE_DB: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def mlflow_db_template(tmp_path_factory):
    """An empty MLflow SQLite store, created (schema migrations: seconds) once per session."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments(max_results=1)
    _TEMPLATE_DB[:] = [db]
    yield db
    _TEMPLATE_DB.clear()


def sweeps_env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return env


def run_cli(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeps.cli", *args], cwd=cwd, env=sweeps_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_cli(cwd: Path, *args: str, log: Path) -> subprocess.Popen:
    out = open(log, "w")
    try:
        return subprocess.Popen([sys.executable, "-m", "sweeps.cli", *args], cwd=cwd, env=sweeps_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def mlflow_client(cwd: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{cwd}/runs/mlflow.db")


def study_runs(cwd: Path, experiment: str) -> tuple[list, list]:
    """(parent runs, trial runs) of an experiment."""
    client = mlflow_client(cwd)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000) if exp else []
    parents = [r for r in runs if r.data.tags.get("sweeps.role") == "study"]
    children = [r for r in runs if r.data.tags.get("sweeps.role") == "trial"]
    return parents, children


def artifact_paths(client, run_id: str) -> set[str]:
    out: set[str] = set()
    todo = [None]
    while todo:
        for a in client.list_artifacts(run_id, todo.pop()):
            out.add(a.path)
            if a.is_dir:
                todo.append(a.path)
    return out


# ---- Ray hygiene ----------------------------------------------------------------------------------
def _pids_using(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line or environment names ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue  # exited, waiting for its parent to reap it
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace")
        except (OSError, IndexError):
            continue
        if marker in cmdline or f"RAY_TMPDIR={marker}" in environ:
            pids.append(int(entry.name))
    return pids


def kill_ray_processes(temp_dir: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL the processes of the Ray instances that used ``temp_dir`` (and only those),
    until none is left; returns the pids it had to kill."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = _pids_using(temp_dir)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.2)
    return killed


@pytest.fixture
def ray_tmp(monkeypatch):
    """A private Ray temp folder (short: Ray's socket paths must stay under 108 bytes)
    for Ray instances this test starts, here or in its subprocesses; their processes
    are killed by pid when the test ends."""
    folder = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", folder)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield folder
    import ray

    if ray.is_initialized():
        ray.shutdown()
    deadline = time.monotonic() + 10
    while _pids_using(folder) and time.monotonic() < deadline:
        time.sleep(0.5)  # a driver's own shutdown is the clean way; give it a moment
    kill_ray_processes(folder)
    shutil.rmtree(folder, ignore_errors=True)
