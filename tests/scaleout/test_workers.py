"""`sweeps worker` on shared PostgreSQL storage: real processes, one study, one total budget,
and a worker killed with SIGKILL mid-trial whose trial another worker fails (heartbeat) and
resumes from its checkpoint."""
from __future__ import annotations

import json
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from sweeps.worker_identity import worker_identity
from tests.scaleout.scaleout_helpers import Output, pg_study, wait_for
from tests.sweeps.study_helpers import cli_in_process, empty_mlflow_db, run_cli, silence_worker, start_cli, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(600)]

# Three training processes share two cores: one thread each.
ENV = {"OMP_NUM_THREADS": "1"}


def _spec(tmp_path: Path, url: str, name: str, **overrides) -> Path:
    shutil.copyfile(empty_mlflow_db(), tmp_path / "mlflow.db")  # already migrated: saves seconds per process
    # Which worker draws which trial depends on timing: keep lr where the MLP never diverges
    # (a diverged trial is PRUNED), so every trial completes whatever is sampled.
    search = {"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}}
    return write_spec(tmp_path, name=name, storage=url, tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"},
                      search=search, **overrides)


def _worker_id(proc) -> str:
    return worker_identity(proc.pid)  # host:boot-id:pid, as the worker names itself


def _start_waiting_worker(tmp_path: Path, spec: Path, spawned: list, **env) -> Output:
    proc = start_cli(tmp_path, "worker", str(spec), "--wait", "300", **{**ENV, **env})
    spawned.append(proc)
    return Output(proc)


def _mlflow_runs(tmp_path: Path, experiment: str) -> tuple:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], max_results=1000)


def test_two_workers_and_sweeps_run_share_one_budget(tmp_path, fresh_db, spawned):
    url = fresh_db()
    spec = _spec(tmp_path, url, "fleet", budget={"n_trials": 8})
    # The workers start before the study exists: each says it waits for `sweeps run`.
    workers = [_start_waiting_worker(tmp_path, spec, spawned) for _ in range(2)]
    wait_for(lambda: all("waiting up to 300 s for `sweeps run" in w.text() for w in workers), timeout=120,
             what=lambda: f"both workers waiting for the study: {[w.text() for w in workers]}")
    # `sweeps run` in a process of its own, beside the two worker processes: three processes share
    # the study's storage and budget at once, as on a cluster.
    run = run_cli(tmp_path, "run", str(spec), "--quiet", timeout=400, **ENV)  # + its own local worker
    assert run.returncode == 0, run.stdout + run.stderr
    for code, out in [w.finish(timeout=120) for w in workers]:
        assert code == 0 and "joining it" in out, out

    study = pg_study(url, "fleet")
    states = [t.state.name for t in study.trials]
    assert len(study.trials) == 8 and states.count("COMPLETE") == 8, states  # the total: no overshoot
    assert sorted(t.number for t in study.trials) == list(range(8))  # no number twice
    by_worker = Counter(t.user_attrs["worker"] for t in study.trials)
    assert {_worker_id(w.proc) for w in workers} <= set(by_worker), by_worker  # both workers ran trials

    # `sweeps run` waited for the other workers' trials before it summarised and closed the parent.
    client, runs = _mlflow_runs(tmp_path, "fleet")
    parents = [r for r in runs if r.data.tags.get("sweeps.role") == "study"]
    children = [r for r in runs if r.data.tags.get("sweeps.role") == "trial"]
    assert len(parents) == 1 and len(children) == 8
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id and c.info.status == "FINISHED"
               for c in children)
    summary = json.loads(Path(client.download_artifacts(parent.info.run_id, "summary/summary.json",
                                                        str(tmp_path))).read_text())
    assert summary["counts"] == {"COMPLETE": 8}


def test_sigkilled_worker_trial_is_failed_by_heartbeat_and_resumed_by_another(tmp_path, fresh_db, spawned):
    url = fresh_db()
    beat = {"SWEEPS_HEARTBEAT_S": "2", "SWEEPS_GRACE_S": "5"}
    spec = _spec(tmp_path, url, "dies", budget={"n_trials": 3})  # 2 epochs: the retry has one left to train
    # The victim SIGKILLs itself once its trial's first epoch is checkpointed and reported.
    victim = _start_waiting_worker(tmp_path, spec, spawned, SWEEPS_FAULT="trial_epoch_reported", **beat)
    wait_for(lambda: "waiting up to" in victim.text(), timeout=120,
             what=lambda: f"the worker waiting for the study: {victim.text()}")
    # `sweeps run`'s worker waits at the start of its first trial until the victim's trial is
    # failed and requeued: the victim surely draws a trial, whichever process asks first, and the
    # retry is there before the worker asks again.
    gate = tmp_path / "run.go"
    run_proc = start_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_HOLD_TRIAL=str(gate), **ENV, **beat)
    spawned.append(run_proc)
    run = Output(run_proc)
    code, out = victim.finish(timeout=400)
    assert code == -signal.SIGKILL, out
    # Its trial's heartbeats ended with it: moved back past the grace period, the trial is failed
    # at a timer's next look, not 5 s on.
    silence_worker(pg_study(url, "dies"), _worker_id(victim.proc))
    wait_for(lambda: any(t.state.name == "WAITING" for t in pg_study(url, "dies").trials), timeout=300, every=0.2,
             what=lambda: f"the dead trial failed and requeued: {run.text()}")
    gate.touch()
    code, out = run.finish(timeout=400)
    assert code == 0, out

    study = pg_study(url, "dies")
    # (A retry inherits its failed attempt's user attributes until a worker takes it.)
    [dead] = [t for t in study.trials if t.user_attrs.get("worker") == _worker_id(victim.proc)
              and t.state.name == "FAIL"]
    assert "heartbeat" in dead.user_attrs["fail_reason"], dead.user_attrs
    assert list(dead.intermediate_values) == [1]  # killed mid-trial, its first epoch reported
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retries) == 1, [(t.number, t.state.name, t.system_attrs) for t in study.trials]
    retry = retries[0]
    assert retry.state.name == "COMPLETE" and retry.params == dead.params, (retry.state, retry.user_attrs)
    assert retry.user_attrs["worker"] != _worker_id(victim.proc)  # run on the surviving worker
    assert retry.user_attrs["fail_reason"] == ""  # the retry does not carry the failed attempt's reason
    assert [t.state.name for t in study.trials].count("COMPLETE") == 3, [t.state.name for t in study.trials]

    client, runs = _mlflow_runs(tmp_path, "dies")
    by_number: dict[int, list] = {}
    for r in runs:
        if r.data.tags.get("sweeps.role") == "trial":
            by_number.setdefault(int(r.data.tags["sweeps.trial_number"]), []).append(r)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    [dead_run] = by_number[dead.number]
    assert dead_run.info.status == "FAILED" and "heartbeat" in dead_run.data.tags["sweeps.error"]
    [retry_run] = by_number[retry.number]
    steps = [m.step for m in client.get_metric_history(retry_run.info.run_id, "val_acc")]
    assert steps == [1, 2], steps  # every epoch: those of its checkpoint are logged into the retry's run
    assert int(retry_run.data.tags["sweeps.resumed_from_epoch"]) == 1  # resumed, not trained from scratch


def test_worker_without_a_study_says_what_to_run(tmp_path, fresh_db):
    spec = _spec(tmp_path, fresh_db(), "nobody")
    proc = cli_in_process(tmp_path, "worker", str(spec), "--wait", "0", **ENV)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sweeps run" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("fan_out", [[], ["--devices", "cpu"]], ids=["worker", "worker_devices"])
def test_a_worker_refused_for_want_of_a_study_writes_no_tracking_store(tmp_path, fresh_db, fan_out):
    store = tmp_path / "not_yet" / "mlflow.db"  # `sweeps run` would create it
    spec = write_spec(tmp_path, name="nostudy", storage=fresh_db(), tracking={"uri": f"sqlite:///{store}"})
    proc = cli_in_process(tmp_path, "worker", str(spec), "--wait", "0", *fan_out, **ENV)
    assert proc.returncode == 2 and "sweeps run" in proc.stderr, proc.stdout + proc.stderr
    assert not store.parent.exists()


def test_a_worker_whose_tracking_server_does_not_answer_fails_before_any_trial(tmp_path, fresh_db, free_port):
    """`sweeps run` made the study (its store answered it); the workers' spec points at a server that
    does not answer from here: each fails with the URI and the fix once it finds the study, and trains
    nothing."""
    url = fresh_db()
    spec = _spec(tmp_path, url, "nosrv", budget={"n_trials": 2})
    run = cli_in_process(tmp_path, "run", str(spec), "--quiet", **ENV)
    assert run.returncode == 0, run.stdout + run.stderr
    write_spec(tmp_path, name="nosrv", storage=url, budget={"n_trials": 4},
               search={"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
               tracking={"uri": f"http://127.0.0.1:{free_port}"})
    for fan_out in ([], ["--devices", "cpu"]):
        proc = cli_in_process(tmp_path, "worker", str(spec), "--wait", "0", *fan_out, **ENV)
        assert proc.returncode == 1, proc.stdout + proc.stderr  # a TrackingError, as `sweeps run` exits
        assert f"127.0.0.1:{free_port}" in proc.stderr and "mlflow server" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
    import optuna

    assert len(optuna.load_study(study_name="nosrv", storage=url).trials) == 2  # nothing trained
