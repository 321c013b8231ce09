"""The Tracker contract (``sweeps.tracking.base.Tracker``), shared by every implementation: each
test takes ``any_tracker`` (conftest), uses only the interface's calls, and reads what they wrote
back from a real MLflow store (sqlite + file artifacts) with MlflowClient. What is particular to
MlflowTracker (batching, the spool, check_connection) is in test_mlflow_tracker.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

from sweeps.errors import TrackingError, UnsafeNameError
from sweeps.tracking import RunHandle, Tracker, layout
from sweeps.tracking.values import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH


def _study(tracker: Tracker, store) -> RunHandle:
    return tracker.start_run("study", experiment=store.experiment_name(), tags={layout.TAG_ROLE: layout.ROLE_STUDY})


def test_is_a_tracker(any_tracker):
    assert isinstance(any_tracker(), Tracker)


def test_nested_parent_and_child_runs(any_tracker, store):
    tracker = any_tracker()
    parent = _study(tracker, store)
    child = tracker.start_run("trial-3", parent=parent,
                              tags={layout.TAG_ROLE: layout.ROLE_TRIAL, layout.TAG_TRIAL_NUMBER: 3})
    assert child == RunHandle(child.run_id, parent.experiment_id, "trial-3")

    got = store.client.get_run(child.run_id)
    assert got.data.tags[layout.PARENT_TAG] == parent.run_id  # what nests it in the UI
    assert got.data.tags[layout.TAG_TRIAL_NUMBER] == "3"
    assert got.info.run_name == "trial-3" and got.info.status == "RUNNING"
    assert layout.PARENT_TAG not in store.client.get_run(parent.run_id).data.tags
    exp = store.client.get_experiment(parent.experiment_id)
    assert exp.artifact_location.endswith(f"artifacts/{exp.name}")
    import mlflow

    assert mlflow.active_run() is None  # never the fluent global run


def test_start_run_gets_or_creates_the_experiment_and_refuses_a_deleted_one(any_tracker, store):
    tracker = any_tracker()
    name = store.experiment_name()
    first = tracker.start_run("a", experiment=name)
    assert tracker.start_run("b", experiment=name).experiment_id == first.experiment_id
    store.client.delete_experiment(first.experiment_id)
    with pytest.raises(TrackingError, match="deleted.*restore"):
        tracker.start_run("c", experiment=name)
    with pytest.raises(UnsafeNameError):
        tracker.start_run("d", experiment="../escape")
    with pytest.raises(ValueError, match="experiment's name or the parent"):
        tracker.start_run("e")


def test_a_non_numeric_metric_is_a_clear_error(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    with pytest.raises(TrackingError, match="'val_acc': 'high'.*not numbers"):
        tracker.log_metrics(run, {"val_loss": 0.1, "val_acc": "high"}, step=1)
    tracker.end_run(run)
    assert store.client.get_run(run.run_id).data.metrics == {}  # nothing half-logged


def test_timestamps_are_taken_when_logged_not_when_sent(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    before = int(time.time() * 1000)
    tracker.log_metrics(run, {"val_acc": 0.5}, step=1)
    after = int(time.time() * 1000)
    time.sleep(0.3)
    tracker.end_run(run)
    (point,) = store.client.get_metric_history(run.run_id, "val_acc")
    assert before <= point.timestamp <= after


@pytest.mark.parametrize("status", ["FINISHED", "FAILED", "KILLED"])
def test_end_run_sends_the_points_then_sets_the_status(any_tracker, store, status):
    tracker = any_tracker()
    run = _study(tracker, store)
    tracker.log_metrics(run, {"val_loss": 1.25}, step=1)
    tracker.end_run(run, status)
    got = store.client.get_run(run.run_id)
    assert got.info.status == status
    assert got.info.end_time is not None
    assert got.data.metrics["val_loss"] == 1.25


def test_end_run_refuses_an_unknown_status(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    with pytest.raises(ValueError, match="FINISHED, FAILED, KILLED"):
        tracker.end_run(run, "PRUNED")  # type: ignore[arg-type]


def test_params_are_stringified_truncated_and_keys_sanitized(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    tracker.log(run, params={"lr": 0.001, "layers": [64, 32], "long": "x" * 7000,
                             "bad key!": 1, "a/../b": 2, None: 3})
    tracker.log(run, tags={"note": "y" * 9000})
    params = store.client.get_run(run.run_id).data.params
    assert params["lr"] == "0.001" and params["layers"] == "[64, 32]"
    assert len(params["long"]) == MAX_PARAM_VAL_LENGTH
    assert params["long"].endswith("...[truncated: 7000 chars in full]")
    assert params["bad key_"] == "1" and params["a/__/b"] == "2" and params["None"] == "3"
    tag = store.client.get_run(run.run_id).data.tags["note"]
    assert len(tag) == MAX_TAG_VAL_LENGTH and "truncated: 9000" in tag


def test_a_later_tag_replaces_an_earlier_one_and_none_removes_it(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    tracker.log(run, params={"lr": 0.1}, tags={"state": "RUNNING", "note": "x"})
    tracker.log(run, tags={"state": "COMPLETE", "note": None, "never_set": None})  # a missing tag: no error
    tags = store.client.get_run(run.run_id).data.tags
    assert tags["state"] == "COMPLETE" and "note" not in tags and "never_set" not in tags


def test_changing_a_param_is_a_clear_error(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    tracker.log(run, params={"lr": 0.1})
    tracker.log(run, params={"lr": 0.1})  # same value again (a resume) is fine
    with pytest.raises(TrackingError, match="refused.*lr"):
        tracker.log(run, params={"lr": 0.2, "bs": 32})


def test_a_run_started_again_from_its_handle_is_running_with_its_tags(any_tracker, store):
    tracker = any_tracker()
    run = _study(tracker, store)
    tracker.log(run, tags={layout.TAG_ERROR: "boom"})
    tracker.end_run(run, "FAILED")
    again = tracker.start_run(run, tags={layout.TAG_ERROR: None, layout.TAG_GIT_COMMIT: "abc"})
    assert again == run
    got = store.client.get_run(run.run_id)
    assert got.info.status == "RUNNING"
    assert layout.TAG_ERROR not in got.data.tags and got.data.tags[layout.TAG_GIT_COMMIT] == "abc"
    tracker.end_run(run, "FINISHED")
    assert store.client.get_run(run.run_id).info.status == "FINISHED"


def test_log_artifact_uploads_files_and_stores_objects(any_tracker, store, tmp_path):
    tracker = any_tracker()
    run = _study(tracker, store)
    ckpt = tmp_path / "best.pt"
    ckpt.write_bytes(b"\x00weights")
    tracker.log_artifact(run, ckpt, layout.ART_CHECKPOINT_DIR)
    tracker.log_artifact(run, str(ckpt))  # a str path, into the run's root
    tracker.log_artifact(run, {"train": {"lr": 0.1}, "seed": 1}, layout.ART_CONFIG)
    tracker.log_artifact(run, [1, 2], "lists/l.yaml")

    names = {a.path for a in store.client.list_artifacts(run.run_id, layout.ART_CHECKPOINT_DIR)}
    assert names == {"checkpoints/best.pt"}
    assert "best.pt" in {a.path for a in store.client.list_artifacts(run.run_id)}
    local = store.client.download_artifacts(run.run_id, layout.ART_CONFIG, str(tmp_path / "dl"))
    assert json.loads(open(local).read()) == {"train": {"lr": 0.1}, "seed": 1}
    assert open(store.client.download_artifacts(run.run_id, "lists/l.yaml", str(tmp_path / "dl2"))).read() == \
        "- 1\n- 2\n"
    with pytest.raises(TrackingError, match="does not exist"):
        tracker.log_artifact(run, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="needs the file's path"):
        tracker.log_artifact(run, {"a": 1})


@pytest.mark.parametrize("bad", ["../x", "/abs", "%2e%2e/x", "a\\b", "a\x00b", "%252e%252e/x", "a/../../b"])
def test_artifact_paths_that_escape_are_refused(any_tracker, store, tmp_path, bad):
    tracker = any_tracker()
    run = _study(tracker, store)
    f = tmp_path / "f.txt"
    f.write_text("x")
    with pytest.raises(UnsafeNameError, match="artifact path"):
        tracker.log_artifact(run, f, bad)
    with pytest.raises(UnsafeNameError, match="artifact file"):
        tracker.log_artifact(run, {"a": 1}, bad + ".json" if "\x00" not in bad else bad)
    assert store.client.list_artifacts(run.run_id) == []


def test_threads_log_to_their_own_runs(any_tracker, store):
    tracker = any_tracker()
    parent = _study(tracker, store)
    runs = [tracker.start_run(f"trial-{i}", parent=parent) for i in range(4)]

    def work(run: RunHandle) -> None:
        for step in range(1, 501):
            tracker.log_metrics(run, {"loss": step}, step)
            if step % 100 == 0:
                tracker.log(run, tags={"last": step})
        tracker.end_run(run, "FINISHED")

    threads = [threading.Thread(target=work, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for run in runs:
        hist = store.client.get_metric_history(run.run_id, "loss")
        assert sorted(m.step for m in hist) == list(range(1, 501))
        got = store.client.get_run(run.run_id)
        assert got.info.status == "FINISHED" and got.data.tags["last"] == "500"


def test_flush_sends_the_buffered_points_and_store_run_id_names_the_run(any_tracker, store):
    tracker = any_tracker(flush_every_s=3600, flush_every_points=10**6)
    run = tracker.start_run("trial-0", parent=_study(tracker, store))
    tracker.log_metrics(run, {"loss": 1.0}, 1)
    assert store.client.get_metric_history(run.run_id, "loss") == []  # buffered
    tracker.flush(run)
    assert [(m.step, m.value) for m in store.client.get_metric_history(run.run_id, "loss")] == [(1, 1.0)]
    assert tracker.store_run_id(run.run_id) == run.run_id  # made while the store answered


def test_log_inputs_records_the_runs_datasets_with_their_context(any_tracker, store):
    tracker = any_tracker()
    run = tracker.start_run("trial-0", parent=_study(tracker, store))
    tracker.log_inputs(run, [{"name": f"toy-{split}", "source": "task:toy", "digest": f"d-{split}",
                              "context": context, "profile": {"num_rows": 5}}
                             for split, context in (("train", "training"), ("val", "validation"))])
    tracker.end_run(run)
    inputs = store.client.get_run(run.run_id).inputs.dataset_inputs
    got = {i.tags[0].value: (i.dataset.name, i.dataset.digest) for i in inputs}
    assert got == {"training": ("toy-train", "d-train"), "validation": ("toy-val", "d-val")}
