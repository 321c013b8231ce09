"""`sweeps worker SPEC --devices ... --gpus-per-trial K` fans out as `sweeps run` does: one worker
process per slot, each pinned with CUDA_VISIBLE_DEVICES, one trial at a time each (issue 26).
On a machine without GPUs the ids are kept as given, so a fake device list plans real slots and
the trials train on CPU."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from sweeps.backends.supervisor import WORKER_MODULE
from sweeps.worker_identity import worker_identity
from tests.scaleout import conftest as scaleout_fixtures
from tests.scaleout.scaleout_helpers import Output, kill_all, pg_study, running_trials, wait_for
from tests.sweeps.study_helpers import cli_in_process, empty_mlflow_db, save_spec, start_cli, tiny_spec

ENV = {"OMP_NUM_THREADS": "1"}
RECORDING = "tests.reliability.device_tasks:make_device_recording_task"

fresh_db, pg_admin = scaleout_fixtures.fresh_db, scaleout_fixtures.pg_admin  # PostgreSQL fixtures, used by name


def _spec(tmp_path: Path, storage: str, name: str, n_trials: int) -> Path:
    shutil.copyfile(empty_mlflow_db(), tmp_path / "mlflow.db")
    spec = tiny_spec(name, storage=storage, tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"},
                     search={"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
                     budget={"n_trials": n_trials, "max_failures": 3})
    spec["task"] = {"target": RECORDING, "model": "mlp", "args": {"width": 32}}  # replaces name: digits
    return save_spec(tmp_path, spec)


@pytest.mark.parametrize("args, expected", [
    (["--devices", "gpu0"], "--devices 'gpu0': write auto"),
    (["--devices", "0,0"], "names a device more than once"),
    (["--devices", "0,1", "--gpus-per-trial", "0.3"], "--gpus-per-trial 0.3: 0.3 is not allowed"),
    (["--devices", "0,1", "--gpus-per-trial", "4"], "--gpus-per-trial: 4.0 is more than the 2 device(s)"),
    (["--devices", "cpu", "--slot", "3"], "--slot 3 cannot be combined with --devices"),
])
def test_a_wrong_flag_is_named_with_the_fix_before_anything_starts(tmp_path, args, expected):
    # Nothing listens on port 1: a flag that got as far as the storage would fail differently.
    spec = _spec(tmp_path, "postgresql://nobody@127.0.0.1:1/none", "flags", 2)
    proc = cli_in_process(tmp_path, "worker", str(spec), *args, "--wait", "0")  # refused before a process starts
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = " ".join(proc.stderr.split())  # the console wraps long lines
    assert expected in said and "Traceback" not in said, proc.stderr


def test_the_flags_reach_the_workers_so_a_two_gpu_trial_runs_two_ddp_ranks(tmp_path, monkeypatch):
    # The spec file says 1 GPU per trial on cpu; `--devices 0,1,2,3 --gpus-per-trial 2` plans two
    # slots of two GPUs, and each worker's trial must run DDP over both as under `sweeps run`.
    from sweeps import trial
    from sweeps.backends.device_fanout import plan_for_flags, with_resources
    from sweeps.backends.optuna_worker import spec_of
    from sweeps.backends.worker_protocol import WorkerGo
    from sweeps.spec.load import load_spec

    spec = load_spec(_spec(tmp_path, "postgresql://nobody@127.0.0.1:1/none", "ddp", 4))
    flags = {"devices": [0, 1, 2, 3], "gpus_per_trial": 2.0}
    slots = plan_for_flags(with_resources(spec, {**flags, "workers": "auto"}), flags)
    assert [s.devices for s in slots] == [(0, 1), (2, 3)]
    assert slots[1].env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    go = WorkerGo(spec_text=spec.text or "", spec_path=str(spec.path), study_name="ddp", study_uid="u",
                  parent_run_id="p", parent_experiment_id="1", parent_run_name="ddp", since=0.0, deadline=None,
                  slot=1, threads=1, beat_file="b", resources=flags)
    in_worker = spec_of(WorkerGo.from_line(go.to_line()))  # as the worker reads it from its stdin
    assert in_worker.resources.gpus_per_trial == 2 and in_worker.resources.devices == [0, 1, 2, 3]
    monkeypatch.setattr(trial, "visible_gpu_count", lambda: 2)  # the two GPUs of its slot
    assert trial.trial_config(in_worker, {"lr": 0.05}).distributed.nproc == 2
    assert trial.trial_config(spec_of(WorkerGo.from_line(go.to_line().replace(
        '"resources": {"devices": [0, 1, 2, 3], "gpus_per_trial": 2.0}', '"resources": null'))),
        {"lr": 0.05}).distributed.nproc == 1  # without the flags: the file's cpu


def _pool_workers(pool: Output) -> set[str]:
    """The trial-side names (host:boot:pid) of the worker processes the pool started and that are
    still running. Any child that has exited (a worker, or a short-lived helper process) may be a
    zombie until it is reaped, or gone between listing and reading it: psutil then refuses its
    command line (one full run failed on a zombie child)."""
    import psutil

    names = set()
    for p in psutil.Process(pool.proc.pid).children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(p.cmdline()):
                names.add(worker_identity(p.pid))
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return names


def _start_pool(tmp_path: Path, spec: Path, *flags: str, **env) -> Output:
    return Output(start_cli(tmp_path, "worker", str(spec), *flags, "--wait", "300", **ENV, **env))


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_each_slot_runs_one_trial_pinned_to_its_devices(tmp_path, fresh_db):
    url, gate, seen = fresh_db(), tmp_path / "go", tmp_path / "devices"
    seen.mkdir()
    spec = _spec(tmp_path, url, "devs", n_trials=3)
    # Every process holds its first trial until the gate opens: with 3 trials, each of the pool's
    # two workers and `sweeps run`'s one worker holds exactly one, whatever the speed of each.
    pool = _start_pool(tmp_path, spec, "--devices", "0,1,2,3", "--gpus-per-trial", "2",
                       SWEEPS_HOLD_TRIAL=str(gate), DEVICES_LOG=str(seen))
    run = Output(start_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_HOLD_TRIAL=str(gate),
                           DEVICES_LOG=str(seen), **ENV))
    try:
        wait_for(lambda: len(running_trials(url)) == 3, timeout=400,
                 what=lambda: f"three held trials: {pool.text()} {run.text()}")
        gate.touch()
        code, out = run.finish(timeout=400)
        assert code == 0, out
        code, out = pool.finish(timeout=120)
        assert code == 0, out
    finally:
        kill_all([pool, run])
    assert "with 2 worker(s) on this machine: slot 0 on GPUs 0,1, slot 1 on GPUs 2,3" in out, out

    trials = pg_study(url, "devs").trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3  # CPU training under fake GPU ids works
    records = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in seen.glob("*.json")}
    by_trial = {t.number: records[int(t.user_attrs["worker"].rsplit(":", 1)[1])] for t in trials}
    for t in trials:  # the trial's name for its process is that process's host:boot:pid
        assert t.user_attrs["worker"] == worker_identity(by_trial[t.number]["pid"])
    pool_trials = [r for r in by_trial.values() if r["ppid"] == pool.proc.pid]
    assert sorted(r["cuda_visible_devices"] for r in pool_trials) == ["0,1", "2,3"]  # one trial per slot
    assert len({r["pid"] for r in pool_trials}) == 2  # two processes, one per slot
    [own] = [r for r in by_trial.values() if r["ppid"] != pool.proc.pid]
    assert own["cuda_visible_devices"] == ""  # `sweeps run`'s worker: resources.devices is cpu


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_sigterm_stops_every_worker_of_the_pool_and_their_trials_are_requeued(tmp_path, fresh_db):
    url, gate = fresh_db(), tmp_path / "go"
    spec = _spec(tmp_path, url, "term", n_trials=3)
    pool = _start_pool(tmp_path, spec, "--devices", "cpu", SWEEPS_HOLD_TRIAL=str(gate))
    run = Output(start_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_HOLD_TRIAL=str(gate), **ENV))
    try:
        # The pool plans its own workers (--devices cpu: one per core), `sweeps run` has one: wait
        # until as many of the 3 trials are held as can be, all but at most one by the pool's workers
        # (named by its children), so the SIGTERM finds them in their trials, however soon `sweeps
        # run`'s worker holds its own.
        def all_held() -> bool:
            held, pool_workers = {t.get("worker") for t in running_trials(url)} - {None}, _pool_workers(pool)
            expected = min(3, len(pool_workers) + 1)  # `sweeps run`'s worker holds at most one
            return ("worker(s) on this machine" in pool.text() and bool(pool_workers) and len(held) == expected
                    and len(held & pool_workers) >= expected - 1)

        wait_for(all_held, timeout=400, what=lambda: f"every worker holding a trial: {pool.text()} {run.text()}")
        pool_ids = _pool_workers(pool) & {t["worker"] for t in running_trials(url)}
        pool.proc.send_signal(signal.SIGTERM)
        code, out = pool.finish(timeout=300)
        assert code == 128 + signal.SIGTERM, out
        gate.touch()
        code, run_out = run.finish(timeout=600)
        assert code == 0, run_out
    finally:
        kill_all([pool, run])
    trials = pg_study(url, "term").trials
    stopped = [t for t in trials if t.state.name == "FAIL"]
    assert stopped and all("SIGTERM" in t.user_attrs["fail_reason"] or t.user_attrs.get("interrupted")
                           for t in stopped), [(t.state, t.user_attrs) for t in trials]
    assert {t.user_attrs["worker"] for t in stopped} == pool_ids  # every pool worker's trial, and only those
    retried = {t.system_attrs.get("failed_trial") for t in trials if t.state.name == "COMPLETE"}
    assert {t.number for t in stopped} <= retried  # each stopped trial was requeued and completed
    assert sum(t.state.name == "COMPLETE" for t in trials) == 3
