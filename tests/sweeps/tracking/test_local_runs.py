"""Runs made while the store is down (``sweeps.tracking.local_runs``): a trial started during an
outage gets a local id, trains and writes on, and its run is created, nested, exactly once, when
the store answers again, by its own tracker or by the next process that reaches the store. Real
stores throughout: a real ``mlflow server`` stopped and started, and a sqlite store."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from sweeps.errors import RunLookupError
from sweeps.tracking import layout, sync_spool
from sweeps.tracking.local_runs import TAG_CLIENT_ID, is_local, known_store_id, new_run_record
from sweeps.tracking.reader import TrackingReader
from sweeps.tracking.spool import Spool

from .test_spool import _assert_exactly, _points


def _tagged(client, experiment_id, client_id):
    return client.search_runs([experiment_id], filter_string=f"tags.`{TAG_CLIENT_ID}` = '{client_id}'")


@pytest.mark.slow  # a real `mlflow server`, started twice
def test_a_trial_started_during_an_outage_is_created_nested_when_the_store_returns(mlflow_server, tmp_path,
                                                                                   fast_http_env):
    from sweeps.tracking import MlflowTracker

    spool = tmp_path / "spool"
    tracker = MlflowTracker(mlflow_server.uri, flush_every_points=10**9, flush_every_s=1e9, spool_dir=spool,
                            retry_interval_s=0.0)
    tracker.check_connection()
    study = tracker.start_run("study", experiment="local-runs", tags={layout.TAG_ROLE: layout.ROLE_STUDY})
    mlflow_server.stop()
    try:
        run = tracker.start_run("trial-0", parent=study, tags={layout.TAG_ROLE: layout.ROLE_TRIAL})
        assert is_local(run.run_id) and run.experiment_id == study.experiment_id
        tracker.log(run, params={"lr": 0.1}, tags={layout.TAG_STATE: "RUNNING"})
        _points(tracker, run, range(1, 501))
        tracker.log_artifact(run, {"made": "offline"}, "eval/note.json")
        tracker.end_run(run, "FINISHED")  # no raise: everything waits in the spool
        assert tracker.spool.has_pending(run.run_id)
    finally:
        mlflow_server.start()

    # The next process that reaches the store (a worker starting, a resumed run) sends it all;
    # the first tracker makes no call meanwhile.
    later = MlflowTracker(mlflow_server.uri, spool_dir=spool)
    later.check_connection()
    assert not Spool(spool).run_ids()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    made = _tagged(client, study.experiment_id, run.run_id)
    assert len(made) == 1
    got = made[0]
    assert got.data.tags[layout.PARENT_TAG] == study.run_id and got.info.run_name == "trial-0"
    assert got.info.status == "FINISHED" and got.data.params == {"lr": "0.1"}
    assert got.data.tags[layout.TAG_STATE] == "RUNNING"
    _assert_exactly(client, got.info.run_id, range(1, 501))
    assert [a.path for a in client.list_artifacts(got.info.run_id, "eval")] == ["eval/note.json"]
    # What the study recorded (the local id) reads back as the store's run, from any machine.
    reader = TrackingReader(mlflow_server.uri)
    assert reader.get_run(run.run_id).info.run_id == got.info.run_id
    assert [r.info.run_id for r in reader.children(study.run_id)] == [got.info.run_id]
    # This machine also knows the new id: the first tracker writes on to the same run.
    assert known_store_id(spool, run.run_id) == got.info.run_id
    tracker.log(run, tags={"after": "yes"})
    assert client.get_run(got.info.run_id).data.tags["after"] == "yes"
    assert len(client.search_runs([study.experiment_id])) == 2  # the study and one trial: nothing twice


def test_a_creation_cut_short_is_adopted_not_made_twice(store, make_tracker, tmp_path):
    """The store made the run but the drain died before recording its id (or the answer to
    create_run was lost): the next drain finds the run by its client id instead of making another."""
    tracker = make_tracker(spool_dir=tmp_path / "spool")
    study = tracker.start_run("study", experiment=store.experiment_name())
    local = "local-" + "ab" * 16
    tags = {layout.PARENT_TAG: study.run_id, TAG_CLIENT_ID: local}
    Spool(tmp_path / "spool", store=store.uri).append(local, [new_run_record(study.experiment_id, "trial-0", tags),
                                                              ["m", "loss", 1.0, 1000, 1], ["end", "FINISHED", 2000]])
    # What a creation that reached the store leaves: the run, and no id on this side.
    store.client.create_run(study.experiment_id, tags=tags, run_name="trial-0")
    make_tracker(spool_dir=tmp_path / "spool").check_connection()
    made = _tagged(store.client, study.experiment_id, local)
    assert len(made) == 1 and made[0].info.status == "FINISHED"
    assert [m.step for m in store.client.get_metric_history(made[0].info.run_id, "loss")] == [1]


def test_only_spools_made_for_this_store_are_sent_to_it(store, make_tracker, tmp_path):
    other_store = f"sqlite:///{tmp_path / 'other.db'}"
    local = "local-" + "cd" * 16
    spool = Spool(tmp_path / "spool", store=other_store)
    exp = store.client.create_experiment(store.experiment_name())
    spool.append(local, [new_run_record(exp, "trial-0", {TAG_CLIENT_ID: local})])
    make_tracker(spool_dir=tmp_path / "spool").check_connection()  # a tracker of `store`: not its spool
    assert spool.run_ids() == [local] and not _tagged(store.client, exp, local)
    out = sync_spool(store.uri, tmp_path / "spool")  # nor by hand with another --uri
    assert local in out["failed"] and "other.db" in out["failed"][local]
    assert spool.run_ids() == [local]


def test_a_local_id_not_yet_sent_is_named_as_such(store):
    with pytest.raises(RunLookupError, match="made while the tracking store was unreachable"):
        TrackingReader(store.uri).get_run("local-" + "ef" * 16)


def test_another_machine_closing_a_run_not_yet_created_waits_for_it(store, make_tracker, tmp_path):
    """Machine B fails a trial of machine A (stale) whose run A made during an outage and has not
    sent yet: B's writes are kept, not refused nor raised, and land in the run once A sends it."""
    from sweeps.tracking.base import RunHandle

    tracker_a = make_tracker(spool_dir=tmp_path / "a")
    study = tracker_a.start_run("study", experiment=store.experiment_name())
    local = "local-" + "12" * 16
    Spool(tmp_path / "a", store=store.uri).append(local, [new_run_record(
        study.experiment_id, "trial-0", {layout.PARENT_TAG: study.run_id, TAG_CLIENT_ID: local})])
    tracker_b = make_tracker(spool_dir=tmp_path / "b")
    run = RunHandle(local, study.experiment_id, "trial-0")
    tracker_b.log(run, tags={layout.TAG_STATE: "FAIL"})
    tracker_b.end_run(run, "FAILED")  # no raise
    assert Spool(tmp_path / "b").run_ids() == [local] and not _tagged(store.client, study.experiment_id, local)
    make_tracker(spool_dir=tmp_path / "a").check_connection()  # machine A is back: it makes the run
    make_tracker(spool_dir=tmp_path / "b").check_connection()  # then B's writes find it
    made = _tagged(store.client, study.experiment_id, local)
    assert len(made) == 1 and made[0].info.status == "FAILED" and made[0].data.tags[layout.TAG_STATE] == "FAIL"
    assert not Spool(tmp_path / "b").run_ids()


def test_sweeps_sync_tracking_creates_a_machines_local_runs_nested_once(store, tmp_path):
    """A machine that never runs `sweeps` again: `sweeps sync-tracking` (the CLI) makes the run it
    created during an outage, nested under the study, sends its points, and a second sync adds nothing."""
    from tests.sweeps.study_helpers import cli_in_process

    exp = store.client.create_experiment(store.experiment_name())
    study = store.client.create_run(exp, run_name="study").info.run_id
    local = "local-" + "34" * 16
    spool = Spool(tmp_path / "spool", store=store.uri)
    spool.append(local, [new_run_record(exp, "trial-0", {layout.PARENT_TAG: study}), ["p", "lr", "0.1"],
                         *(["m", "val_acc", 0.5 + s / 10, 1_700_000_000_000 + s, s] for s in (1, 2, 3)),
                         ["end", "FINISHED", 1_700_000_001_000]])

    def sync():
        return cli_in_process(tmp_path, "sync-tracking", "--uri", store.uri, "--spool", str(tmp_path / "spool"))

    first = sync()
    assert first.returncode == 0, first.stdout + first.stderr
    [made] = _tagged(store.client, exp, local)
    assert made.data.tags[layout.PARENT_TAG] == study and made.info.run_name == "trial-0"
    assert made.info.status == "FINISHED" and made.data.params == {"lr": "0.1"}
    assert [m.step for m in store.client.get_metric_history(made.info.run_id, "val_acc")] == [1, 2, 3]
    assert not Spool(tmp_path / "spool").run_ids()
    assert sync().returncode == 0 and len(_tagged(store.client, exp, local)) == 1
    assert len(store.client.get_metric_history(made.info.run_id, "val_acc")) == 3
