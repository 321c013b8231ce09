"""TrackingReader against a real MLflow store: runs written by an MlflowTracker, read back the
way status, report, promote, rerun and the Ray driver read them."""
from __future__ import annotations

import time

import pytest

from sweeps.tracking import TrackingReader, layout
from sweeps.tracking.reader import RunLookupError


@pytest.fixture
def reader(store) -> TrackingReader:
    return TrackingReader(store.uri)


def test_find_run_finds_the_newest_run_carrying_every_tag(make_tracker, store, reader):
    tracker = make_tracker()
    study = {layout.TAG_ROLE: layout.ROLE_STUDY, layout.TAG_STUDY: "lr_bs"}
    name = store.experiment_name()
    assert reader.experiment_id(name) is None
    first = tracker.start_run("study", experiment=name, tags=study)
    eid = reader.experiment_id(name)
    assert eid == first.experiment_id
    assert reader.find_run(eid, {**study, layout.TAG_BACKEND: "optuna"}) is None
    other = tracker.start_run("other", experiment=name, tags={**study, layout.TAG_STUDY: "other's"})
    trial = tracker.start_run("trial-7", parent=first,
                              tags={layout.TAG_ROLE: layout.ROLE_TRIAL, layout.TAG_TRIAL_NUMBER: 7})
    assert reader.find_run(eid, study) == first
    assert reader.find_run(eid, {layout.TAG_STUDY: "other's"}) == other  # a quote in the value
    assert reader.find_run(eid, {layout.TAG_TRIAL_NUMBER: 7}) == trial
    time.sleep(0.01)
    newer = tracker.start_run("study", experiment=name, tags=study)
    assert reader.find_run(eid, study) == newer  # the most recently started wins
    store.client.delete_run(newer.run_id)
    assert reader.find_run(eid, study) == first  # deleted runs are not found
    store.client.delete_experiment(eid)
    assert reader.experiment_id(name) is None  # nor deleted experiments


def test_children_by_tags_and_status_in_either_order(make_tracker, store, reader):
    tracker = make_tracker()
    parent = tracker.start_run("study", experiment=store.experiment_name())
    trials = []
    for i in range(3):
        trials.append(tracker.start_run(f"trial-{i}", parent=parent, tags={layout.TAG_ROLE: layout.ROLE_TRIAL}))
        time.sleep(0.01)
    rerun = tracker.start_run("rerun", parent=parent, tags={layout.TAG_ROLE: layout.ROLE_RERUN})
    tracker.end_run(trials[1])
    ids = [r.info.run_id for r in reader.children(parent.run_id, oldest_first=True)]
    assert ids == [t.run_id for t in trials] + [rerun.run_id]
    running = reader.children(parent.run_id, {layout.TAG_ROLE: layout.ROLE_TRIAL}, status="RUNNING")
    assert [r.info.run_id for r in running] == [trials[2].run_id, trials[0].run_id]  # newest first
    assert len(reader.children(parent.run_id, max_results=2)) == 2


def test_runs_metrics_and_artifacts(make_tracker, store, reader, tmp_path):
    tracker = make_tracker()
    run = tracker.start_run("study", experiment=store.experiment_name())
    for step in (1, 2):
        tracker.log_metrics(run, {"val_acc": step / 10}, step)
    tracker.log_artifact(run, {"suggestion": 0.1}, "lr_finder/lr_finder.json")
    tracker.end_run(run)

    assert reader.handle(run.run_id) == run
    assert reader.experiment_name(run.experiment_id) == store.client.get_experiment(run.experiment_id).name
    assert reader.get_run(run.run_id).data.metrics == {"val_acc": 0.2}
    assert sorted((m.step, m.value) for m in reader.metric_history(run.run_id, "val_acc")) == [(1, 0.1), (2, 0.2)]
    assert reader.list_artifacts(run.run_id, "lr_finder") == ["lr_finder/lr_finder.json"]
    local = reader.download_artifact(run.run_id, "lr_finder/lr_finder.json", tmp_path)
    assert local.read_text().strip().startswith("{") and local.parent.is_relative_to(tmp_path)

    with pytest.raises(RunLookupError, match="not found at"):
        reader.get_run("f" * 32)
    store.client.delete_run(run.run_id)
    with pytest.raises(RunLookupError, match="is deleted"):
        reader.handle(run.run_id)
