"""A diverged trial's forensics reach its MLflow run: diverged.json under diagnostics/ and the
worst gradient and the anomaly's culprit in the sweeps.reason tag (the trial is PRUNED)."""
from __future__ import annotations

import json

from core.train import train
from sweeps import trial
from sweeps.trial_control import TrialControl
from tests.core.helpers import fast_config
from tests.core.test_forensics import _NanBackward


def test_diverged_json_and_the_reason_land_in_the_trials_run(tmp_path, store, make_tracker):
    from sweeps.tracking import TrackingReader

    tracker = make_tracker()
    run = tracker.start_run("trial-0000", experiment=store.experiment_name())
    reporter = trial.TrialReporter(tracker, run, "val_acc", TrialControl())
    result = train(_NanBackward(), fast_config(epochs=1, detect_anomaly=True), reporter=reporter,
                   out_dir=tmp_path / "trial")
    outcome = trial.outcome_of(result, run)
    trial.finish_trial_run(tracker, run, outcome)

    reader = TrackingReader(tracker.tracking_uri)
    assert "diagnostics/diverged.json" in reader.list_artifacts(run.run_id, "diagnostics")
    logged = json.loads(reader.download_artifact(run.run_id, "diagnostics/diverged.json", tmp_path / "dl").read_text())
    assert logged == json.loads((tmp_path / "trial" / "diverged.json").read_text())
    assert {"global_step", "micro_batch_index", "input_stats", "step_losses", "largest_grad_norms", "lr",
            "amp_scale", "anomaly"} <= logged.keys()
    run_data = reader.get_run(run.run_id).data
    assert outcome.state == "PRUNED" and run_data.tags["sweeps.reason"] == "diverged: " + result.reason
    assert "first NaN in backward: LogBackward0" in run_data.tags["sweeps.reason"]
    assert "largest grad norm fc." in run_data.tags["sweeps.reason"]
