"""Ray's ContinuingTracker on a trial that starts again: it continues the trial's own MLflow run
(the contract's other cases, with no run to continue, are in test_tracker_contract.py)."""
from __future__ import annotations

from sweeps.backends.ray_trainable import ContinuingTracker
from sweeps.tracking import layout


def test_a_trial_started_again_continues_its_run_and_keeps_its_first_params(make_tracker, store):
    inner = make_tracker()
    parent = inner.start_run("study", experiment=store.experiment_name())
    first = ContinuingTracker(inner, existing=None)
    run = first.start_run("trial-0", parent=parent, tags={layout.TAG_STATE: "RUNNING"})
    first.log(run, params={"lr": 0.1})
    first.log_artifact(run, {"params": {"lr": 0.1}}, layout.ART_CONFIG)
    first.log_metrics(run, {"val_acc": 0.5}, 1)
    first.log(run, tags={layout.TAG_STATE: "PRUNED", layout.TAG_PRUNED: "true", "sweeps.reason": "paused"})
    first.end_run(run, "KILLED")

    again = ContinuingTracker(inner, existing=run)
    assert again.start_run("trial-0", parent=parent, tags={"sweeps.pbt_from": 3}) == run
    again.log(run, params={"lr": 0.2})  # a PBT exploit's new lr: not a param (it is in tags)
    again.log_artifact(run, {"params": {"lr": 0.2}}, layout.ART_CONFIG)  # the first config stays
    again.log_metrics(run, {"val_acc": 0.6}, 2)
    again.log(run, tags={layout.TAG_STATE: "COMPLETE"})
    again.end_run(run, "FINISHED")

    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.data.params == {"lr": "0.1"}
    tags = got.data.tags
    assert tags[layout.TAG_STATE] == "COMPLETE" and tags["sweeps.pbt_from"] == "3"
    assert layout.TAG_PRUNED not in tags and "sweeps.reason" not in tags  # the stale end-of-run tags went
    assert sorted(m.step for m in store.client.get_metric_history(run.run_id, "val_acc")) == [1, 2]
    runs = store.client.search_runs([parent.experiment_id], f"tags.`{layout.PARENT_TAG}` = '{parent.run_id}'")
    assert [r.info.run_id for r in runs] == [run.run_id]  # one run per trial
    config = store.client.download_artifacts(run.run_id, layout.ART_CONFIG, str(store.root / run.run_id))
    assert '"lr": 0.1' in open(config).read()
