"""The peer benchmark at tiny sizes: every arm (sweeps run, the plain Optuna + MLflow script at
n_jobs 1 and 2, the MLflowCallback script, Ray Tune) runs its trials, and what each recorded,
read back from its MLflow store, is what the records table says. Speed is never asserted."""
from __future__ import annotations

import json

import pytest

from benchmarks.bench_peers import ARMS, PEERS, first_trial_seconds
from benchmarks.common import bench_main
from benchmarks.peers.records import recorded, table
from tests.benchmarks.test_bench_smoke import check_schema
from tests.sweeps.study_helpers import migrated_store

N_TRIALS = 2


@pytest.mark.slow
@pytest.mark.ray
def test_peers_quick_every_arm_completes_and_records_what_the_table_says(tmp_path):
    out = tmp_path / "peers.json"
    assert bench_main(["peers", "--quick", "--out", str(out), "--opt", 'studies=["lr_bs_nopruning"]',
                       "--opt", f"study={json.dumps({'n_trials': N_TRIALS, 'epochs': 1})}"]) == 0
    result = json.loads(out.read_text())
    check_schema(result, "peers")  # status ok: every arm of every round finished its trials
    (row,) = result["rows"]
    assert row["case"] == "lr_bs_nopruning: sweeps vs best peer" and row["target"].startswith(">= 1.2x")
    (round_,) = result["details"]["rounds"]["lr_bs_nopruning"]
    assert set(round_) == set(ARMS)
    for arm_name, res in round_.items():
        assert "error" not in res, res.get("error")
        rec = res["records"]
        assert res["trials"] == rec["trial_runs"] == N_TRIALS, arm_name
        assert rec["statuses"] == {"FINISHED": N_TRIALS}, (arm_name, rec["statuses"])
        assert rec["nested"] == N_TRIALS and rec["study_runs"] == 1, arm_name
        # Every trial run holds per-epoch val_acc, the per-step loss and a checkpoint.
        assert rec["epoch_curves"] == rec["step_curves"] == rec["checkpoints"] == N_TRIALS, (arm_name, rec)
        assert "val_acc" in rec["epoch_keys"] and "step/train_loss" in rec["step_keys"], arm_name
        assert rec["step_points"] >= N_TRIALS * -(-1437 // 128), arm_name  # an epoch at the largest batch
        # Without pruning every sweeps trial completes, so each has a verified ONNX model; no peer exports one.
        assert rec["onnx"] == (N_TRIALS if arm_name == "sweeps run" else 0), arm_name
        assert rec["system_metrics"] == (N_TRIALS if arm_name == "sweeps run" else 0), arm_name
        # Three events, in order, one wall clock: the trial's run made, its first optimizer step, its first epoch.
        assert 0 < res["first_trial_s"] <= res["first_step_s"] <= res["first_epoch_s"], (arm_name, res)
    details = row["details"]
    assert details["records"] == {a: round_[a]["records"] for a in ARMS}  # the table shows the last round
    lines = details["records_table"]
    assert lines[0].startswith("| arm | trial runs | nested |") and len(lines) == 2 + len(ARMS)
    assert lines[2].startswith(f"| sweeps run | {N_TRIALS} | {N_TRIALS} |")
    assert set(details["sweeps_over_each_peer"]) == set(PEERS)
    split = result["details"]["breakdown"]
    assert split["from_trial_runs"]["trials"] == N_TRIALS
    trial = split["from_trial_runs"]
    assert 0 < trial["train_loop_s_median"] < trial["trial_s_median"]
    parts = split["components"]
    for key in ("onnx_export_and_check_first_s", "onnx_export_and_check_later_s", "checkpoint_epoch_s",
                "tracking_sweeps_s", "tracking_plain_client_s"):
        assert parts[key] > 0, key
    assert len(parts["imports"]) == 3


def test_records_are_read_from_the_store_not_assumed(tmp_path):
    """A trial run without a checkpoint or step curve is counted as such: the table can say no."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = migrated_store(tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("s", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp).info.run_id
    full = client.create_run(exp, tags={"mlflow.parentRunId": parent}).info.run_id
    bare = client.create_run(exp, tags={"mlflow.parentRunId": parent}).info.run_id
    loose = client.create_run(exp).info.run_id  # not nested under the study
    client.log_batch(full, metrics=[Metric("step/train_loss", 1.0, 0, s) for s in range(6)]
                     + [Metric(k, 1.0, 0, e) for k in ("val_acc", "val_loss") for e in (1, 2)])
    (tmp_path / "best.pt").write_bytes(b"x")
    client.log_artifact(full, str(tmp_path / "best.pt"), "checkpoints")
    client.log_batch(bare, metrics=[Metric("val_loss", 1.0, 0, 1)])
    for run in (full, bare, loose, parent):
        client.set_terminated(run)
    rec = recorded(uri, "s")
    assert (rec["trial_runs"], rec["nested"], rec["study_runs"]) == (3, 2, 1)
    assert (rec["step_curves"], rec["epoch_curves"], rec["checkpoints"], rec["onnx"]) == (1, 2, 1, 0)
    assert rec["step_keys"] == ["step/train_loss"] and rec["epoch_keys"] == ["val_acc", "val_loss"]
    assert table({"x": rec})[2].startswith("| x | 3 | 2 | 0 | 2 | 1 | 0 | 1 | 0 | 0 |")


def test_time_to_the_first_trial_is_read_from_the_runs_start_and_first_epoch(tmp_path):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = migrated_store(tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("s", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, start_time=1_000_000).info.run_id
    first = client.create_run(exp, tags={"mlflow.parentRunId": parent}, start_time=1_004_500).info.run_id
    later = client.create_run(exp, tags={"mlflow.parentRunId": parent}, start_time=1_006_000).info.run_id
    client.log_batch(first, metrics=[Metric("val_loss", 1.0, 1_007_250, 0), Metric("val_loss", 1.0, 1_009_000, 1)])
    client.log_batch(later, metrics=[Metric("val_loss", 1.0, 1_008_000, 0)])
    rec = recorded(uri, "s")
    assert (rec["first_trial_start_ms"], rec["first_epoch_ms"]) == (1_004_500, 1_007_250)
    assert first_trial_seconds(rec, 1_000.0) == {"first_trial_s": 4.5, "first_epoch_s": 7.25}
    assert first_trial_seconds({}, 1_000.0) == {"first_trial_s": None, "first_epoch_s": None}
