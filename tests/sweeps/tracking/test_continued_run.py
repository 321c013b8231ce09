"""A trial that starts again (a Ray trial after a crash, a pause, a PBT exploit) continues its own
MLflow run: a mode of the trial (``TrialSpec.continues``), written through the plain Tracker."""
from __future__ import annotations

import json

from sweeps.backends.ray_continuing_run import logged_up_to
from sweeps.spec.load import spec_from_dict
from sweeps.tracking import TrackingReader, layout
from sweeps.trial import TrialOutcome, TrialSpec, finish_trial_run, start_trial_run
from sweeps.trial_control import TrialControl
from sweeps.trial_reporter import TrialReporter

SPEC = {"name": "t", "task": {"name": "digits", "model": "mlp"}, "train": {"epochs": 2, "batch_size": 64},
        "search": {"lr": {"type": "float", "low": 1e-3, "high": 1.0, "log": True}}}


def test_a_trial_started_again_continues_its_run_and_keeps_its_first_params(make_tracker, store, tmp_path):
    spec = spec_from_dict(SPEC)
    tracker = make_tracker()
    parent = tracker.start_run("study", experiment=store.experiment_name())
    first = TrialSpec(0, {"lr": 0.1}, tmp_path / "trial-0000", parent, "ray")
    run = start_trial_run(spec, tracker, first)
    TrialReporter(tracker, run, "val_acc", TrialControl()).report_epoch(1, 10, {"val_acc": 0.5})
    finish_trial_run(tracker, run, TrialOutcome("PRUNED", 0.5, "paused", run))  # Ray paused it

    held = logged_up_to(TrackingReader(store.uri), run.run_id)
    again = TrialSpec(0, {"lr": 0.2}, tmp_path / "trial-0000", parent, "ray", tags={"sweeps.pbt_from": 3},
                      continues=run, logged_up_to=held)  # a PBT exploit's new lr: in tags, not a param
    assert start_trial_run(spec, tracker, again) == run
    reporter = TrialReporter(tracker, run, "val_acc", TrialControl(), held)
    reporter.report_epoch(1, 10, {"val_acc": 0.55})  # trained again from an older checkpoint: not logged twice
    reporter.report_epoch(2, 20, {"val_acc": 0.6})
    finish_trial_run(tracker, run, TrialOutcome("COMPLETE", 0.6, "", run), held)

    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.data.params["lr"] == "0.1"
    tags = got.data.tags
    assert tags[layout.TAG_STATE] == "COMPLETE" and tags["sweeps.pbt_from"] == "3"
    assert layout.TAG_PRUNED not in tags and "sweeps.reason" not in tags  # the stale end-of-run tags went
    history = store.client.get_metric_history(run.run_id, "val_acc")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.6)]
    runs = store.client.search_runs([parent.experiment_id], f"tags.`{layout.PARENT_TAG}` = '{parent.run_id}'")
    assert [r.info.run_id for r in runs] == [run.run_id]  # one run per trial
    config = store.client.download_artifacts(run.run_id, layout.ART_CONFIG, str(tmp_path / "dl"))
    assert json.loads(open(config).read())["params"] == {"lr": 0.1}  # the first config stays
