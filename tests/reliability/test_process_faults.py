"""Real processes, real signals: `sweeps run` SIGKILLed mid-trial, a worker killed in the middle
of a checkpoint write and one killed after training, SIGTERM and SIGINT: nothing is lost.

The kills inside a worker are deterministic: ``SWEEPS_FAULT=mid_checkpoint`` makes a worker
SIGKILL itself with the new checkpoint written but not yet in place, ``SWEEPS_FAULT=after_training``
once train() has ended, before anything records the outcome (core/faults.py). `sweeps run` fails
and requeues the dead worker's trial. A kill of `sweeps run` itself waits for a durable state (a
RUNNING trial whose last.pt exists), never for a transient file."""
from __future__ import annotations

import functools
import json
import math
import signal
import time
from pathlib import Path

import pytest

from core import checkpoint as ckpt
from core.faults import Fault
from tests.sweeps.study_helpers import ROOT, cli_in_process, load_study, mlflow_runs, run_cli, start_cli, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
EPOCHS, BATCH = 3, 32


def _gated_spec(tmp_path: Path, name: str) -> Path:
    """Three trials of the digits MLP whose first process waits in epoch 2 until the test opens a
    gate (tests/reliability/fault_tasks.py:GatedTask); one failure in a row stops a `sweeps run`."""
    return write_spec(tmp_path, name=name, task={"name": None, "target": "fault_tasks:make_gated_task",
                                                 "model": "mlp", "args": {}},
                      train={"epochs": EPOCHS, "batch_size": BATCH}, budget={"n_trials": 3, "max_failures": 1})


def _steps_per_epoch() -> int:
    from core.tasks.digits import DigitsTask

    train, _ = DigitsTask("mlp").datasets()
    return math.ceil(len(train) / BATCH)


def _wait_for(predicate, proc=None, every: float = 0.2):
    """Wait until ``predicate()`` returns something true (a durable state, not a transient file)
    and return it. No deadline of its own: the test's pytest timeout is the hang guard. A
    `sweeps run` (``proc``) that exits meanwhile fails the test at once."""
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"sweeps run exited with {proc.returncode} first:\n{proc.stdout.read()}")
        time.sleep(every)


def _running_trial_with_checkpoint(tmp_path: Path, name: str):
    """A RUNNING trial whose last.pt exists (None while there is none)."""
    if not (tmp_path / "runs" / f"{name}.journal").exists():
        return None
    try:
        study = load_study(tmp_path, name)
    except Exception:  # noqa: BLE001 - the journal may be mid-write while the study runs: poll again
        return None
    running = [t for t in study.trials if t.state.name == "RUNNING"]
    return next((t for t in running if (tmp_path / t.user_attrs.get("out_dir", "/nonexistent") / ckpt.LAST).exists()),
                None)


def _assert_pids_gone(pids: list[int]) -> None:
    for pid in pids:
        _wait_for(functools.partial(_gone, pid), every=0.05)


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "zombie" in _proc_state(pid)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def _worker_pids(orchestrator_pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"PPid:\t{orchestrator_pid}\n" in text:
            out.append(int(status.parent.name))
    return out


def test_kills_mid_trial_mid_checkpoint_and_after_training_then_a_rerun_completes_without_loss(tmp_path, monkeypatch):
    spec = _gated_spec(tmp_path, "kill")
    gate = tmp_path / "gate-open"
    env = {"PYTHONPATH": f"{HERE}:{ROOT}", "GATE_AFTER": str(_steps_per_epoch()), "GATE_OPEN": str(gate)}

    # 1. SIGKILL of `sweeps run` itself while its first trial runs, held in epoch 2 with the
    #    checkpoint of epoch 1 on disk.
    proc = start_cli(tmp_path, "run", str(spec), "--quiet", **env)
    held = _wait_for(lambda: _running_trial_with_checkpoint(tmp_path, "kill"), proc)
    workers = _worker_pids(proc.pid)
    assert workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    _assert_pids_gone(workers)  # the workers die with the orchestrator (PDEATHSIG)
    gate.touch()  # from now on nothing waits
    folder = tmp_path / held.user_attrs["out_dir"]
    last = folder / ckpt.LAST
    epoch_1 = last.read_bytes()
    assert ckpt.load_checkpoint(last)["epoch"] == 1

    # Steps 2 to 4 run their driver in this process (the kills are its workers'): it checks the target.
    monkeypatch.syspath_prepend(str(HERE))

    # 2. The next `sweeps run` fails that trial as orphaned and requeues it; the retry resumes,
    #    trains epoch 2 and its worker is killed in the middle of writing epoch 2's checkpoint.
    second = cli_in_process(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT="mid_checkpoint", **env)
    assert second.returncode == 1, second.stdout + second.stderr  # budget.max_failures: 1 failure stops it
    assert [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the write that was cut short
    assert last.read_bytes() == epoch_1  # the torn file never replaced last.pt
    state, path = ckpt.load_resume_state(folder)
    assert path == last and state["epoch"] == 1

    # 3. The retry of that retry resumes from epoch 1, trains to the end, saves the final
    #    checkpoint, and its worker is killed before anything records the outcome.
    third = cli_in_process(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT="after_training", **env)
    assert third.returncode == 1, third.stdout + third.stderr
    final_state = ckpt.load_checkpoint(last)
    assert final_state["epoch"] == EPOCHS and final_state["progress"] is None
    trained = last.read_bytes()

    # 4. Without faults the study finishes; the trial's last retry has nothing left to train.
    final = cli_in_process(tmp_path, "run", str(spec), "--quiet", **env)
    assert final.returncode == 0, final.stdout + final.stderr
    assert last.read_bytes() == trained  # it resumed from the final checkpoint: not trained again

    study = load_study(tmp_path, "kill")
    states = [t.state.name for t in study.trials]
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 3, states  # exactly budget.n_trials
    assert len({t.number for t in study.trials}) == len(study.trials)
    assert not [t for t in study.trials if t.state.name in ("RUNNING", "WAITING")], states
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    reasons = [t.user_attrs["fail_reason"] for t in failed]
    assert len(failed) == 3, reasons  # one per kill
    assert "orphaned" in reasons[0] and all("killed by SIGKILL" in r for r in reasons[1:]), reasons
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") is not None]
    # Every failed trial was requeued, each retry of the same parameters and folder.
    assert all(any(t.number in r.system_attrs.get("retry_history", []) for r in retries) for t in failed)
    [done] = [t for t in finished if t.user_attrs["out_dir"] == held.user_attrs["out_dir"]]
    assert done.system_attrs["retry_history"] == [t.number for t in failed] and done.params == held.params

    runs = [r for r in mlflow_runs(tmp_path, "kill") if r.data.tags.get("sweeps.role") == "trial"]
    assert not [r for r in runs if r.info.status == "RUNNING"]
    by_number = {int(r.data.tags["sweeps.trial_number"]): r for r in runs}
    for t, word in zip(failed, ("orphaned", "killed by SIGKILL", "killed by SIGKILL"), strict=True):
        assert by_number[t.number].info.status == "FAILED"
        assert word in by_number[t.number].data.tags["sweeps.error"]
    # The finished retry's run holds the whole curve (one point per epoch), as the checkpoint does.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    run = by_number[done.number]
    assert run.info.status == "FINISHED"
    val_acc = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_acc"))
    assert [s for s, _ in val_acc] == list(range(1, EPOCHS + 1))
    assert val_acc == [(h["epoch"], h["val_acc"]) for h in json.loads(final_state["history_json"])]


@pytest.mark.parametrize("fault,code", [(Fault.DRIVER_SIGTERM_MID_TRIAL, 143), (Fault.DRIVER_SIGINT_MID_TRIAL, 130)])
def test_sigterm_checkpoints_fails_and_requeues_then_resumes(tmp_path, fault, code):
    # The driver signals itself once its first trial has reported an epoch, and that trial waits
    # there for the stop (core/faults.py): a trial mid-way with its checkpoint on disk, on any machine.
    name = f"term{code}"
    spec = write_spec(tmp_path, name=name, budget={"n_trials": 2})
    stopped = run_cli(tmp_path, "run", str(spec), "--quiet", SWEEPS_FAULT=fault.value)
    assert stopped.returncode == code, stopped.stdout + stopped.stderr
    study = load_study(tmp_path, name)
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert len(failed) == 1 and "interrupted" in failed[0].user_attrs["fail_reason"]
    assert (tmp_path / failed[0].user_attrs["out_dir"] / ckpt.LAST).exists()  # it checkpointed
    waiting = [t for t in study.trials if t.state.name == "WAITING"]
    assert len(waiting) == 1 and waiting[0].params == failed[0].params
    run = {int(r.data.tags["sweeps.trial_number"]): r for r in mlflow_runs(tmp_path, name)
           if r.data.tags.get("sweeps.role") == "trial"}[failed[0].number]
    assert run.info.status == "KILLED" and "interrupted" in run.data.tags["sweeps.error"]

    again = cli_in_process(tmp_path, "run", str(spec), "--quiet")  # the resume: its driver's process is not the point
    assert again.returncode == 0, again.stderr
    study = load_study(tmp_path, name)
    assert len([t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]) == 2
    retry = [t for t in study.trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE"
    assert not [r for r in mlflow_runs(tmp_path, name) if r.info.status == "RUNNING"]
