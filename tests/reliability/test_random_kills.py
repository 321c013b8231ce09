"""Ten SIGKILLs at random moments (of `sweeps run` or one of its workers), then a clean finish:
the study ends with exactly n_trials, no point drawn twice, nothing left RUNNING, and every
finished trial with its full curves (trust issue, "Done when")."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import cli_in_process, load_study, mlflow_runs, start_cli, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
KILLS = 10
EPOCHS = 3


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _kill_at_random(proc: subprocess.Popen, rng: random.Random) -> bool:
    """Let the study run a random while, then SIGKILL a worker or `sweeps run` itself (its
    workers die with it), and end the invocation. False when it had finished first."""
    try:
        proc.wait(timeout=rng.uniform(1.0, 8.0))
        return False
    except subprocess.TimeoutExpired:
        pass
    workers = _children(proc.pid)
    if workers and rng.random() < 0.5:
        victim = rng.choice(workers)  # as the OOM killer would; the supervisor replaces it
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=rng.uniform(0.5, 4.0))
            return True
        except subprocess.TimeoutExpired:
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.2)  # let PR_SET_PDEATHSIG take the workers down before the next invocation
    return True


@pytest.mark.parametrize("workers", [1, 2])
def test_ten_random_sigkills_then_a_clean_finish_lose_nothing(tmp_path, workers):
    n_trials = 6
    spec = write_spec(tmp_path, name="kills", task={"args": {"width": 256}},
                      train={"epochs": EPOCHS, "batch_size": 32},
                      budget={"n_trials": n_trials, "max_failures": 100},
                      resources={"devices": "cpu", "workers": workers})
    rng = random.Random(1000 + workers)
    kills = rounds = 0
    while kills < KILLS and rounds < 3 * KILLS:
        rounds += 1
        proc = start_cli(tmp_path, "run", str(spec), "--quiet")
        try:
            if _kill_at_random(proc, rng):
                kills += 1
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        if proc.returncode == 0:
            break  # the study finished between two kills
    final = cli_in_process(tmp_path, "run", str(spec), "--quiet")  # the clean finish: its process is not the point
    assert final.returncode == 0, final.stdout + final.stderr

    trials = load_study(tmp_path, "kills").trials
    assert sum(t.state.name == "COMPLETE" for t in trials) == n_trials
    assert not [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    # What the sampler drew: not the retries of killed trials (their parameters requeued), nor enqueued ones.
    drawn = [tuple(sorted(t.params.items())) for t in trials
             if "fixed_params" not in t.system_attrs and "failed_trial" not in t.system_attrs]
    assert len(drawn) == len(set(drawn)), "the sampler drew a point twice"
    runs = {r.info.run_id: r for r in mlflow_runs(tmp_path, "kills")}
    assert not [r.info.run_name for r in runs.values() if r.info.status == "RUNNING"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    step_counts = set()
    for t in trials:
        if t.state.name != "COMPLETE":
            continue
        run_id = t.user_attrs["mlflow_run_id"]
        assert runs[run_id].info.status == "FINISHED"
        epochs = sorted(m.step for m in client.get_metric_history(run_id, "val_acc"))
        assert epochs == list(range(1, EPOCHS + 1)), (t.number, epochs)
        steps = sorted({m.step for m in client.get_metric_history(run_id, "step/train_loss")})
        assert steps == list(range(1, steps[-1] + 1)), (t.number, steps[:3], len(steps))
        step_counts.add(len(steps))
    assert len(step_counts) == 1 and step_counts.pop() > EPOCHS  # every trial has every step, resumed or not
