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

from tests.sweeps import study_helpers
from tests.sweeps.study_helpers import save_spec, tiny_spec, with_overrides


def write_spec(folder: Path, name: str = "tiny", backend: str = "optuna", **overrides) -> Path:
    """The tiny study (study_helpers.tiny_spec) on ``backend``: three trials at batch 64."""
    spec = tiny_spec(name, description="tiny backend test study", backend=backend,
                     train={"batch_size": 64}, budget={"n_trials": 3, "max_failures": 1})
    return save_spec(folder, with_overrides(spec, **overrides))


# One thread per training process: trials and the test share two cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run_cli(cwd: Path, *args: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    return study_helpers.run_cli(cwd, *args, timeout=timeout, **{**ONE_THREAD, **env})


def start_cli(cwd: Path, *args: str, log: Path) -> subprocess.Popen:
    out = open(log, "w")
    try:
        return subprocess.Popen([sys.executable, "-m", "sweeps.cli", *args], cwd=cwd,
                                env=study_helpers.sweeps_env(**ONE_THREAD), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


def mlflow_client(cwd: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{cwd}/runs/mlflow.db")


def study_runs(cwd: Path, experiment: str) -> tuple[list, list]:
    """(parent runs, trial runs) of an experiment."""
    runs = study_helpers.mlflow_runs(cwd, experiment)
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
