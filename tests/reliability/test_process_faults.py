"""Real processes, real signals: SIGKILL and SIGTERM of `sweeps run` mid-trial lose nothing."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import load_study, mlflow_runs, run_cli, start_cli, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _slow_spec(tmp_path: Path, name: str, n_trials: int = 3) -> Path:
    # A wide MLP makes each checkpoint tens of MB, so a kill can land inside a checkpoint write.
    return write_spec(tmp_path, name=name, task={"args": {"width": 1024}},
                      train={"epochs": 4, "batch_size": 32}, budget={"n_trials": n_trials})


def _wait_for(predicate, timeout: float = 180, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def _trial_dirs(tmp_path: Path, name: str) -> list[Path]:
    base = tmp_path / "runs" / name
    return sorted(base.glob("trial-*")) if base.exists() else []


def _checkpointed_trial_running(tmp_path: Path, name: str) -> bool:
    journal = tmp_path / "runs" / f"{name}.journal"
    if not journal.exists():
        return False
    try:
        study = load_study(tmp_path, name)
    except Exception:
        return False
    running = [t for t in study.trials if t.state.name == "RUNNING"]
    return any((tmp_path / t.user_attrs.get("out_dir", "/nonexistent") / "last.pt").exists() for t in running)


def _temp_checkpoint(tmp_path: Path, name: str) -> bool:
    return any(p.name.startswith(".last.") for d in _trial_dirs(tmp_path, name) for p in d.iterdir())


def _assert_pids_gone(pids: list[int]) -> None:
    for pid in pids:
        _wait_for(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in _proc_state(pid), timeout=20)


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


def test_sigkill_twice_mid_trial_then_rerun_completes_without_loss(tmp_path):
    spec = _slow_spec(tmp_path, "kill")
    # 1st kill: while a trial runs with a checkpoint on disk.
    proc = start_cli(tmp_path, "run", str(spec), "--quiet")
    _wait_for(lambda: _checkpointed_trial_running(tmp_path, "kill"))
    workers = _worker_pids(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _assert_pids_gone(workers)  # the workers die with the orchestrator (PDEATHSIG)

    # 2nd kill: during a checkpoint write (a temporary checkpoint file exists).
    proc = start_cli(tmp_path, "run", str(spec), "--quiet")
    _wait_for(lambda: _temp_checkpoint(tmp_path, "kill"), every=0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    final = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert final.returncode == 0, final.stdout + final.stderr
    study = load_study(tmp_path, "kill")
    states = [t.state.name for t in study.trials]
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 3, states
    assert len({t.number for t in study.trials}) == len(study.trials)
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert len(failed) >= 2 and all("orphaned" in t.user_attrs["fail_reason"] for t in failed)
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") is not None]
    # Every failed trial was requeued (a retry may itself be killed and requeued again).
    assert all(any(t.number in r.system_attrs.get("retry_history", []) for r in retries) for t in failed)

    runs = [r for r in mlflow_runs(tmp_path, "kill") if r.data.tags.get("sweeps.role") == "trial"]
    assert not [r for r in runs if r.info.status == "RUNNING"]
    by_number = {int(r.data.tags["sweeps.trial_number"]): r for r in runs}
    for t in failed:
        assert by_number[t.number].info.status == "FAILED"
        assert "orphaned" in by_number[t.number].data.tags["sweeps.error"]
    # Retries resumed from their checkpoints instead of starting again at epoch 1.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    first_steps = [[m.step for m in client.get_metric_history(by_number[t.number].info.run_id, "val_acc")]
                   for t in retries if t.state.name == "COMPLETE"]
    assert any(steps and steps[0] > 1 for steps in first_steps), first_steps
    leftovers = [p for d in _trial_dirs(tmp_path, "kill") for p in d.iterdir() if p.name.startswith(".last.")]
    assert all(p.stat().st_size >= 0 for p in leftovers)  # a torn temp file never replaced last.pt


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_checkpoints_fails_and_requeues_then_resumes(tmp_path, signum, code):
    name = f"term{code}"
    spec = _slow_spec(tmp_path, name, n_trials=2)
    proc = start_cli(tmp_path, "run", str(spec), "--quiet")
    _wait_for(lambda: _checkpointed_trial_running(tmp_path, name))
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out
    study = load_study(tmp_path, name)
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert len(failed) == 1 and "interrupted" in failed[0].user_attrs["fail_reason"]
    waiting = [t for t in study.trials if t.state.name == "WAITING"]
    assert len(waiting) == 1 and waiting[0].params == failed[0].params
    run = {int(r.data.tags["sweeps.trial_number"]): r for r in mlflow_runs(tmp_path, name)
           if r.data.tags.get("sweeps.role") == "trial"}[failed[0].number]
    assert run.info.status == "KILLED" and "interrupted" in run.data.tags["sweeps.error"]

    again = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert again.returncode == 0, again.stderr
    study = load_study(tmp_path, name)
    assert len([t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]) == 2
    retry = [t for t in study.trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE"
    assert not [r for r in mlflow_runs(tmp_path, name) if r.info.status == "RUNNING"]
