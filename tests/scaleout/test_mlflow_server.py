"""A study tracked by a real MLflow tracking server (PostgreSQL backend store, proxied artifacts),
read back through the server's REST API only."""
from __future__ import annotations

import pytest

from tests.scaleout.scaleout_helpers import rest
from tests.sweeps.study_helpers import cli_in_process, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]


def test_study_tracked_by_an_mlflow_server_over_http(tmp_path, fresh_db, mlflow_server):
    base, artifacts = mlflow_server
    spec = write_spec(tmp_path, name="served", storage=fresh_db(), tracking={"uri": base}, budget={"n_trials": 3})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    experiment = rest(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=served")["experiment"]
    assert experiment["artifact_location"].startswith("mlflow-artifacts:")  # the server stores artifacts
    runs = rest(base, "/api/2.0/mlflow/runs/search",
                {"experiment_ids": [experiment["experiment_id"]], "max_results": 100})["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs}
    parents = [r for r in runs if tags[r["info"]["run_id"]].get("sweeps.role") == "study"]
    children = [r for r in runs if tags[r["info"]["run_id"]].get("sweeps.role") == "trial"]
    assert len(parents) == 1 and len(children) == 3, tags
    parent_id = parents[0]["info"]["run_id"]
    assert parents[0]["info"]["status"] == "FINISHED"
    for child in children:
        run_id = child["info"]["run_id"]
        assert tags[run_id]["mlflow.parentRunId"] == parent_id
        assert child["info"]["status"] == "FINISHED" and tags[run_id]["sweeps.state"] == "COMPLETE"
        assert {m["key"] for m in child["data"]["metrics"]} >= {"val_acc", "objective"}
        # Uploaded through the server (--serve-artifacts) into its --artifacts-destination.
        stored = artifacts / experiment["experiment_id"] / run_id / "artifacts"
        assert (stored / "config" / "resolved_config.json").is_file(), sorted(artifacts.rglob("*"))
        listed = rest(base, f"/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=config")
        assert [f["path"] for f in listed["files"]] == ["config/resolved_config.json"]
    assert sorted(int(tags[c["info"]["run_id"]]["sweeps.trial_number"]) for c in children) == [0, 1, 2]
    assert (artifacts / experiment["experiment_id"] / parent_id / "artifacts" / "summary" / "summary.json").is_file()
