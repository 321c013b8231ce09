"""A study is defined by one snapshot of its spec, read once (trust issue, defect 5): an edit made
while `sweeps run` starts reaches neither its workers nor its records."""
from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.sweeps.study_helpers import mlflow_runs, start_cli, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_editing_the_spec_after_sweeps_run_read_it_changes_nothing(tmp_path):
    spec = write_spec(tmp_path, name="snap", train={"epochs": 1}, budget={"n_trials": 2})
    proc = start_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_PAUSE="spec_read")
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # it stopped itself right after reading the spec
    assert os.WIFSTOPPED(status)
    edited = yaml.safe_load(spec.read_text())
    edited["train"]["epochs"] = 4
    spec.write_text(yaml.safe_dump(edited, sort_keys=False))
    os.kill(proc.pid, signal.SIGCONT)
    out = proc.communicate(timeout=500)[0]
    assert proc.returncode == 0, out

    runs = mlflow_runs(tmp_path, "snap")
    trials = [r for r in runs if r.data.tags.get("sweeps.role") == "trial"]
    assert len(trials) == 2 and {r.data.params["epochs"] for r in trials} == {"1"}
    (parent,) = [r for r in runs if r.data.tags.get("sweeps.role") == "study"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    logged = client.download_artifacts(parent.info.run_id, "spec/snap.yaml", str(tmp_path / "dl"))
    assert yaml.safe_load(open(logged).read())["train"]["epochs"] == 1  # the snapshot, not the edited file
    resolved = client.download_artifacts(parent.info.run_id, "spec/resolved_spec.json", str(tmp_path / "dl"))
    assert json.load(open(resolved))["train"]["epochs"] == 1
