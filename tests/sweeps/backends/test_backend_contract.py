"""The contract every backend keeps: the same study through `sweeps run` gives the same
MLflow layout, the same status mapping, and a `Backend.load` / `sweeps status` view that
matches MLflow, whichever backend ran it.

One tiny digits study per backend: a grid over three learning rates, one of which
diverges (non-finite loss: PRUNED, MLflow KILLED + sweeps.pruned), two epochs, ONNX export.
"""
from __future__ import annotations

import math

import pytest

from tests.sweeps.backends.conftest import artifact_paths, mlflow_client, run_cli, study_runs, write_spec

pytestmark = pytest.mark.slow

LRS = [0.05, 0.3, 1.0e6]  # the last one diverges in its first epoch


def _spec(tmp_path, backend):
    return write_spec(
        tmp_path, name=f"contract_{backend}", backend=backend,
        train={"export_onnx": True},
        search={"lr": {"type": "categorical", "choices": LRS}},
        sampler={"name": "grid", "seed": 0},
        budget={"n_trials": 3, "max_failures": 1},
        resources={"devices": "cpu", "workers": 2 if backend == "ray" else 1},
    )


@pytest.fixture(params=["optuna", pytest.param("ray", marks=pytest.mark.ray)])
def finished_study(request, tmp_path, monkeypatch):
    backend = request.param
    if backend == "ray":
        request.getfixturevalue("ray_tmp")
    spec_path = _spec(tmp_path, backend)
    proc = run_cli(tmp_path, "run", str(spec_path), "--quiet", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    monkeypatch.chdir(tmp_path)  # the spec's paths (runs/...) are relative to the working directory
    return backend, spec_path, proc


def test_same_mlflow_layout_status_mapping_and_load(finished_study, tmp_path):
    from sweeps.backends import get_backend
    from sweeps.spec import load_spec

    backend, spec_path, proc = finished_study
    name = f"contract_{backend}"
    assert "promote it:" in proc.stdout  # the end-of-run summary

    parents, children = study_runs(tmp_path, name)
    assert len(parents) == 1 and len(children) == len(LRS)
    parent = parents[0]
    assert parent.data.tags["sweeps.backend"] == backend
    assert parent.info.status == "FINISHED"  # closed at the end of the invocation
    client = mlflow_client(tmp_path)
    assert "summary/summary.json" in artifact_paths(client, parent.info.run_id)

    by_lr = {}
    for child in children:
        tags, params = child.data.tags, child.data.params
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["sweeps.backend"] == backend
        assert any(k.startswith("train.") for k in params) and "search.lr" in params
        assert client.get_metric_history(child.info.run_id, "step/train_loss"), "per-step curve"
        arts = artifact_paths(client, child.info.run_id)
        assert "config/resolved_config.json" in arts
        by_lr[float(params["search.lr"])] = (child, arts)
    assert sorted(by_lr) == sorted(LRS)

    for lr in LRS[:2]:  # trained normally
        child, arts = by_lr[lr]
        assert child.info.status == "FINISHED" and child.data.tags["sweeps.state"] == "COMPLETE"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val_acc")] == [1, 2]
        assert {"checkpoints/best.pt", "onnx/model.onnx"} <= arts
    child, _ = by_lr[LRS[2]]  # diverged: pruned, not failed
    assert child.info.status == "KILLED" and child.data.tags["sweeps.pruned"] == "true"
    assert child.data.tags["sweeps.state"] == "PRUNED"

    # Backend.load: the same trials, states and values as MLflow
    result = get_backend(backend).load(load_spec(spec_path))
    assert result.backend == backend and result.parent_run_id == parent.info.run_id
    mlflow_view = {int(c.data.tags["sweeps.trial_number"]): c for c in children}
    assert sorted(t.number for t in result.trials) == sorted(mlflow_view)
    for t in result.trials:
        run = mlflow_view[t.number]
        assert t.run_id == run.info.run_id
        assert t.state == run.data.tags["sweeps.state"]
        assert t.params == {"lr": float(run.data.params["search.lr"])}
        objective = run.data.metrics.get("objective")
        if t.state == "COMPLETE":
            assert t.value is not None and math.isclose(t.value, objective, rel_tol=1e-9)
            assert sorted(t.intermediate) == [1, 2]
            assert math.isclose(t.intermediate[2], run.data.metrics["val_acc"], rel_tol=1e-9)
    best = result.best()
    assert best is not None and parent.data.tags.get("sweeps.best_trial") == str(best.number)

    # `sweeps status` lists every trial, whichever backend ran the study
    status = run_cli(tmp_path, "status", str(spec_path))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"({backend})" in status.stdout
    lines = status.stdout.splitlines()
    for t in result.trials:
        assert any(f" {t.number} " in line and t.state in line for line in lines), status.stdout
