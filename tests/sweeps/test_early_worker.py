"""The workers `sweeps run` starts before validating its spec: started only where their devices
can be chosen later, each adopted once by the Optuna backend, killed when nobody adopts them."""
from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import pytest

from sweeps.backends import early_worker
from sweeps.pool import auto_cpu_workers, cpu_threads_available
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


@pytest.mark.parametrize("workers, started", [(1, 1), (2, 2), ("auto", None)])
def test_started_for_an_optuna_cpu_study_each_adopted_once(tmp_path, workers, started):
    spec = write_spec(tmp_path, seed_store=False, resources={"devices": "cpu", "workers": workers})
    early_worker.start_early_workers(str(spec))
    procs = []
    while (worker := early_worker.adopt_early_worker(os.path.relpath(spec))) is not None:  # any path to it
        procs.append(worker.proc)
        for conn in worker.tracking_ends:  # nobody serves its MLflow writes: it never gets a go
            conn.close()
    # auto: as many as the plan makes on this machine's CPU threads
    assert len(procs) == (started or auto_cpu_workers(cpu_threads_available()))
    for proc in procs:
        assert proc.poll() is None
        proc.stdin.close()  # EOF instead of a go: the worker stops by itself, having written nothing
    assert [proc.wait(timeout=120) for proc in procs] == [0] * len(procs)
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not list(tmp_path.glob("runs/*.journal"))


@pytest.mark.parametrize("changes", [{"backend": "ray"}, {"resources": {"devices": "auto"}}])
def test_not_started_where_it_could_not_serve(tmp_path, monkeypatch, changes):
    """Ray runs its own workers; with an NVIDIA driver present, devices: auto means a GPU
    must be chosen before the worker starts."""
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: True if str(p) == "/proc/driver/nvidia" else real_exists(p))
    spec = write_spec(tmp_path, seed_store=False, **changes)
    early_worker.start_early_workers(str(spec))
    assert early_worker.adopt_early_worker(spec) is None


def test_an_invalid_spec_is_reported_once_and_leaves_no_worker(tmp_path):
    spec = write_spec(tmp_path, name="bad", seed_store=False, train={"epochs": -1})
    proc = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 2
    assert proc.stderr.count("train.epochs") == 1, proc.stderr  # the orchestrator's message only
    time.sleep(0.2)
    assert not [c for c in _command_lines() if "optuna_worker" in c and str(spec) in c]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("export_onnx", [True, False])
def test_a_worker_warms_the_onnx_exporter_up_where_its_trials_export(tmp_path, monkeypatch, export_onnx):
    """Before its go: the first trial's export then costs what the others' do."""
    import core.onnx_export as onnx_export
    from sweeps.backends import optuna_worker
    from sweeps.spec import load_spec

    spec = load_spec(write_spec(tmp_path, seed_store=False, train={"export_onnx": export_onnx}))
    monkeypatch.setattr(onnx_export, "_registries", {})  # as in a fresh worker
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # EOF instead of a go
    assert optuna_worker._warm_up_then_wait(spec, served=True) is None
    assert bool(onnx_export._registries) is export_onnx
