"""WriterProcessTracker beyond the Tracker contract (test_mlflow_tracker.py runs that on it too,
threads included): the trainer's cost per point, and what happens when the writer or the
trainer dies.
Real writer processes, real signals, a real MLflow sqlite store."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sweeps.errors import TrackingError
from sweeps.tracking import RunHandle, layout
from sweeps.tracking.writer import WriterProcessTracker

pytestmark = pytest.mark.slow  # writer processes (each imports MLflow) and trainer processes

ROOT = Path(__file__).resolve().parents[3]


def _run(tracker, store, name: str = "trial") -> RunHandle:
    eid = tracker.get_or_create_experiment(store.experiment_name())
    return tracker.start_run(eid, name, tags={layout.TAG_ROLE: layout.ROLE_TRIAL})


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int) -> None:
    """Wait until process ``pid`` has exited. No deadline of its own: a process that never
    leaves is a hang, which the test's pytest timeout reports."""
    while _alive(pid):
        time.sleep(0.05)


@pytest.mark.timeout(300)  # a hang guard: a log_metrics that waited for the stopped writer would never return
def test_logging_ships_without_waiting_and_every_point_arrives(shared_writer_tracker, store, monkeypatch):
    from sweeps.tracking.mlflow_tracker import MlflowTracker

    tracker = shared_writer_tracker
    run = _run(tracker, store)
    tracker.flush(run)  # the writer is up
    n = 3000

    def written_here(*args, **kwargs):
        raise AssertionError("the trainer wrote to the store itself")

    monkeypatch.setattr(MlflowTracker, "_submit", written_here)  # the in-process write path
    pid = tracker.writer_pid
    os.kill(pid, signal.SIGSTOP)  # any call that waited for the writer would now wait forever
    try:
        for step in range(1, n + 1):
            tracker.log_metrics(run, {"step/train_loss": 1.0 / step, "step/lr": 0.1}, step)
        tracker.end_run(run, "FINISHED")
        assert store.client.get_metric_history(run.run_id, "step/lr") == []
    finally:
        os.kill(pid, signal.SIGCONT)
    monkeypatch.undo()
    tracker.flush()
    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED"
    for key in ("step/train_loss", "step/lr"):
        assert sorted(m.step for m in store.client.get_metric_history(run.run_id, key)) == list(range(1, n + 1))


def test_points_the_store_refuses_are_raised_by_the_next_flush_of_their_run(shared_writer_tracker, store):
    tracker = shared_writer_tracker
    doomed, other = _run(tracker, store, "doomed"), _run(tracker, store, "other")
    store.client.delete_run(doomed.run_id)  # a deleted run takes no writes
    tracker.log_metrics(doomed, {"loss": 1.0}, 1)
    tracker.log_metrics(other, {"loss": 1.0}, 1)
    time.sleep(0.15)
    tracker.log_metrics(other, {"loss": 2.0}, 2)  # the buffer is due: both runs' points are shipped
    tracker.flush(other)  # the other run's flush does not carry the doomed run's refusal
    with pytest.raises(TrackingError, match=f"refused.*{doomed.run_id}"):
        tracker.flush(doomed)
    tracker.flush(doomed)  # said once
    assert sorted(m.value for m in store.client.get_metric_history(other.run_id, "loss")) == [1.0, 2.0]


@pytest.mark.timeout(300)  # a hang guard: an end_run that waited for the stopped writer would never return
def test_end_run_hands_the_run_to_the_writer_without_waiting_for_the_store(store, tmp_path):
    tracker = WriterProcessTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root)
    run = _run(tracker, store)
    tracker.log_metrics(run, {"loss": 0.5}, 1)
    tracker.flush(run)  # the writer is up and has written the point
    pid = tracker.writer_pid
    os.kill(pid, signal.SIGSTOP)  # a request would now wait for as long as the writer is stopped
    try:
        tracker.log_metrics(run, {"loss": 0.25}, 2)
        tracker.end_run(run, "FINISHED")  # returns although nothing can answer it
        assert store.client.get_run(run.run_id).info.status == "RUNNING"
    finally:
        os.kill(pid, signal.SIGCONT)
    tracker.flush()  # waits for the writer: the run's last point and its status are in
    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.info.end_time <= int(time.time() * 1000)
    assert [m.value for m in store.client.get_metric_history(run.run_id, "loss")] == [0.5, 0.25]
    tracker.close()


def test_a_killed_writer_is_reported_and_the_trainer_writes_by_itself(store, tmp_path, caplog):
    tracker = WriterProcessTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root)
    run = _run(tracker, store)
    tracker.log_metrics(run, {"val_acc": 0.5}, 1)
    tracker.flush(run)
    pid = tracker.writer_pid
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    tracker.log_metrics(run, {"val_acc": 0.6}, 2)
    tracker.log_params(run, {"lr": 0.1})  # the first request after the kill finds it gone
    tracker.end_run(run, "FINISHED")
    assert tracker.writer_pid is None
    assert "MLflow writer" in caplog.text and "is gone" in caplog.text
    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.data.params == {"lr": "0.1"}
    assert [m.value for m in store.client.get_metric_history(run.run_id, "val_acc")] == [0.5, 0.6]


def _trainer(store, tmp_path: Path, body: str) -> subprocess.Popen:
    """A process that starts a WriterProcessTracker, prints its writer's pid and the run id,
    then runs ``body``."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from sweeps.tracking.writer import WriterProcessTracker
        t = WriterProcessTracker({store.uri!r}, spool_dir={str(tmp_path / 'spool')!r},
                                 artifact_root={str(store.artifact_root)!r})
        eid = t.get_or_create_experiment({store.experiment_name()!r})
        run = t.start_run(eid, "trial")
        print(t.writer_pid, run.run_id, flush=True)
    """) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


def _kill_once_it_says(proc: subprocess.Popen, line: str) -> str:
    """SIGKILL a :func:`_trainer` once it prints ``line``; wait until its writer has left (the
    pipe closed: it writes what it holds, then goes). Returns the trainer's run id."""
    writer_pid, run_id = proc.stdout.readline().split()
    assert proc.stdout.readline().strip() == line
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _wait_gone(int(writer_pid))
    return run_id


def test_points_shipped_before_the_trainer_is_killed_are_written(store, tmp_path):
    proc = _trainer(store, tmp_path, """
        for step in range(1, 201):
            t.log_metrics(run, {"loss": 1.0 / step}, step)
            time.sleep(0.001)
        time.sleep(0.15)
        t.log_metrics(run, {"loss": 0.0}, 201)  # ships: the buffer is older than 0.1 s
        print("shipped", flush=True)
        time.sleep(60)
    """)
    run_id = _kill_once_it_says(proc, "shipped")
    steps = sorted(m.step for m in store.client.get_metric_history(run_id, "loss"))
    assert steps == list(range(1, 202))
    assert store.client.get_run(run_id).info.status == "RUNNING"  # the trainer never ended it


def test_a_run_ended_just_before_the_trainer_is_killed_is_written_with_its_status(store, tmp_path):
    proc = _trainer(store, tmp_path, """
        for step in range(1, 51):
            t.log_metrics(run, {"loss": 1.0 / step}, step)
        t.end_run(run, "FINISHED")  # returns before the writer has written it
        print("ended", flush=True)
        time.sleep(60)
    """)
    run_id = _kill_once_it_says(proc, "ended")
    assert store.client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in store.client.get_metric_history(run_id, "loss")) == list(range(1, 51))


@pytest.mark.timeout(300)  # a hang guard: a writer that stayed would be waited for until then
def test_the_writer_leaves_with_a_trainer_that_exits_before_asking_anything(store, tmp_path):
    """As when a sweep's set-up fails: the writer is still importing MLflow when its parent goes.
    Here its import of MLflow never ends (a stand-in package that says it started, then blocks),
    so the writer can only leave by noticing that its parent is gone, not after its imports."""
    blocking, importing = tmp_path / "blocking-imports", tmp_path / "writer-is-importing-mlflow"
    (blocking / "mlflow").mkdir(parents=True)
    (blocking / "mlflow" / "__init__.py").write_text(
        f"import threading\nopen({str(importing)!r}, 'w').close()\nthreading.Event().wait()  # never returns\n")
    code = textwrap.dedent(f"""
        import os, time
        from sweeps.tracking.writer import WriterProcessTracker
        os.environ["PYTHONPATH"] = {str(blocking)!r} + os.pathsep + os.environ["PYTHONPATH"]  # the writer's
        t = WriterProcessTracker({store.uri!r}, spool_dir={str(tmp_path / 'spool')!r})
        print(t.writer_pid, flush=True)
        while not os.path.exists({str(importing)!r}):  # the writer is importing MLflow (and stays there)
            time.sleep(0.05)
        os._exit(0)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The writer inherits the trainer's stdout: read the pid line only, never up to the end.
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               text=True, env=env)
    pid = int(trainer.stdout.readline())
    try:
        assert trainer.wait() == 0
        _wait_gone(pid)
    finally:
        trainer.stdout.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if _alive(pid) and "sweeps.tracking.writer" in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)  # the test failed (timed out): leave nothing behind


def test_without_a_writer_process_the_trainer_writes_by_itself(store, tmp_path, monkeypatch, caplog):
    from sweeps.tracking import writer

    def no_process(config):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(writer, "_start_writer", no_process)
    tracker = WriterProcessTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root)
    assert tracker.writer_pid is None and "cannot start the MLflow writer process" in caplog.text
    run = _run(tracker, store)
    tracker.log_metrics(run, {"val_acc": 0.5}, 1)
    tracker.end_run(run, "FINISHED")
    tracker.close()
    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.data.metrics["val_acc"] == 0.5


def test_a_worker_served_by_sweeps_run_writes_without_importing_mlflow(store, tmp_path):
    """As `sweeps run` serves a local worker with no writer process of its own: the worker
    (a real process, with the worker module imported) ships its writes over the pipe to a
    thread of this process and never imports MLflow. When it is killed, the thread writes
    what it had shipped, then ends."""
    from sweeps.tracking.mlflow_tracker import MlflowTracker
    from sweeps.tracking.writer import open_served_pipe, serve_in_thread
    from tests.sweeps.study_helpers import write_spec

    spec_path = write_spec(tmp_path, seed_store=False)
    child_fds, ends = open_served_pipe()
    code = textwrap.dedent(f"""
        import sys, time
        from multiprocessing.connection import Connection
        import sweeps.backends.optuna_worker
        from sweeps.spec import load_spec
        from sweeps.study_run import tracker_for
        spec = load_spec({str(spec_path)!r})
        served = (Connection({child_fds[0]}, readable=False), Connection({child_fds[1]}, writable=False))
        t = tracker_for(spec, served_by=served)
        run = t.start_run(t.get_or_create_experiment({store.experiment_name()!r}), "trial")
        for step in range(1, 101):
            t.log_metrics(run, {{"loss": 1.0 / step}}, step)
        time.sleep(0.15)
        t.log_metrics(run, {{"loss": 0.0}}, 101)  # ships: the buffer is older than 0.1 s
        print(run.run_id, "mlflow" in sys.modules, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env=env, pass_fds=child_fds, cwd=tmp_path)
    for fd in child_fds:
        os.close(fd)
    server = serve_in_thread(ends, lambda: MlflowTracker(store.uri, spool_dir=tmp_path / "spool",
                                                         artifact_root=store.artifact_root), name="test-worker")
    try:
        run_id, imported = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait()
    assert imported == "False"
    server.join(timeout=30)
    assert not server.is_alive()  # the pipe closed with the worker: the thread wrote what it held and ended
    assert sorted(m.step for m in store.client.get_metric_history(run_id, "loss")) == list(range(1, 102))
    assert store.client.get_run(run_id).info.status == "RUNNING"  # the worker never ended it
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # nothing written by the worker itself


def test_a_served_worker_whose_server_is_gone_writes_by_itself(store, tmp_path, caplog):
    from multiprocessing.connection import Connection

    from sweeps.tracking.writer import open_served_pipe

    (req_w, rep_r), ends = open_served_pipe()
    tracker = WriterProcessTracker(store.uri, spool_dir=tmp_path / "spool", artifact_root=store.artifact_root,
                                   served_by=(Connection(req_w, readable=False), Connection(rep_r, writable=False)))
    assert tracker.writer_pid == os.getppid()  # served by the process that started this one
    for conn in ends:  # the serving side is gone (sweeps run stopped serving, or failed to)
        conn.close()
    run = _run(tracker, store)
    tracker.log_metrics(run, {"val_acc": 0.5}, 1)
    tracker.end_run(run, "FINISHED")
    tracker.close()
    assert tracker.writer_pid is None and "is gone" in caplog.text
    got = store.client.get_run(run.run_id)
    assert got.info.status == "FINISHED" and got.data.metrics["val_acc"] == 0.5
