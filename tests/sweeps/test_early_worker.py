"""The worker `sweeps run` starts before validating its spec: started only where its devices
can be chosen later, adopted once by the Optuna backend, killed when nobody adopts it."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sweeps.backends import early_worker
from tests.sweeps.study_helpers import run_cli, write_spec


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    early_worker.stop_early_workers()


def _command_lines() -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            out.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def test_started_for_an_optuna_cpu_study_adopted_once_then_gone(tmp_path):
    spec = write_spec(tmp_path, seed_store=False)
    early_worker.start_early_worker(str(spec))
    proc = early_worker.adopt_early_worker(os.path.relpath(spec))  # the same file by another path
    assert proc is not None and proc.poll() is None
    assert early_worker.adopt_early_worker(spec) is None  # handed over once
    proc.stdin.close()  # EOF instead of a go: the worker stops by itself, having written nothing
    assert proc.wait(timeout=120) == 0
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not list(tmp_path.glob("runs/*.journal"))


@pytest.mark.parametrize("changes", [{"backend": "ray"}, {"resources": {"devices": "auto"}}])
def test_not_started_where_it_could_not_serve(tmp_path, monkeypatch, changes):
    """Ray runs its own workers; with an NVIDIA driver present, devices: auto means a GPU
    must be chosen before the worker starts."""
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: True if str(p) == "/proc/driver/nvidia" else real_exists(p))
    spec = write_spec(tmp_path, seed_store=False, **changes)
    early_worker.start_early_worker(str(spec))
    assert early_worker.adopt_early_worker(spec) is None


def test_an_invalid_spec_is_reported_once_and_leaves_no_worker(tmp_path):
    spec = write_spec(tmp_path, name="bad", seed_store=False, train={"epochs": -1})
    proc = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 2
    assert proc.stderr.count("train.epochs") == 1, proc.stderr  # the orchestrator's message only
    time.sleep(0.2)
    assert not [c for c in _command_lines() if "optuna_worker" in c and str(spec) in c]
    assert not (tmp_path / "runs").exists()
