"""A study on a real one-node SLURM cluster (scripts/slurm_local.sh: Debian's slurmctld, slurmd and
munge) through ``sweeps slurm``: a 2-task job array on PostgreSQL storage, one task preempted
(``scancel --batch --signal=TERM``, then ``scontrol requeue``). The signal reaches the worker
(the batch script execs it), which checkpoints its trial, requeues it in the study and exits; the
requeued task starts again, takes the requeued trial and resumes it from its checkpoint; the study
completes with every trial once and nothing RUNNING.

Every trial first waits at its start (``SWEEPS_HOLD_TRIAL``) until a trial runs in each task, and
then after each reported (and checkpointed) epoch (``SWEEPS_HOLD_MID_TRIAL``) until the requeued task
1 has taken the stopped trial's retry: the signal meets a trial mid-training whatever the machine's
speed, and task 0, still held, cannot take the retry first."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.scaleout.scaleout_helpers import pg_study, running_trials, wait_for
from tests.sweeps.study_helpers import ROOT, run_cli, write_spec

pytestmark = [pytest.mark.slurm, pytest.mark.postgres, pytest.mark.timeout(1500)]

SCRIPT = ROOT / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """SLURM_CONF of the local cluster, started (and installed, as root) by scripts/slurm_local.sh."""
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.fail("needs SLURM: sbatch is not installed and only root can install it. As root, run "
                    "scripts/slurm_local.sh start (.ci/run does), or run `make test-fast`, which leaves the "
                    "slurm tests out", pytrace=False)
    done = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"scripts/slurm_local.sh start failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}",
                    pytrace=False)
    conf = re.search(r"export SLURM_CONF=(\S+)", done.stdout)
    assert conf, done.stdout
    return {"SLURM_CONF": conf.group(1)}


def slurm(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def task_state(env: dict[str, str], job: str, index: int) -> str:
    """The array task's JobState (kept by slurmctld for MinJobAge after it ends)."""
    found = re.search(r"JobState=(\S+)", slurm(env, "scontrol", "show", "job", f"{job}_{index}"))
    assert found
    return found.group(1)


def task1_trial_reported(storage: str, tracking: str) -> bool:
    """Whether the trial that array task 1 (``--slot 1``) runs has reported an epoch."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    exp = client.get_experiment_by_name("slurmy")
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], "tags.`sweeps.worker_slot` = '1' and attributes.status = 'RUNNING'")
    numbers = {int(r.data.tags["sweeps.trial_number"]) for r in runs}
    return any(t.number in numbers and t.intermediate_values for t in pg_study(storage, "slurmy").trials)


def test_a_preempted_array_task_checkpoints_requeues_and_resumes(tmp_path, fresh_db, slurm_env):
    storage = fresh_db()
    n_trials = 4
    tracking = f"sqlite:///{tmp_path}/runs/mlflow.db"
    spec = write_spec(tmp_path, name="slurmy", storage=storage, budget={"n_trials": n_trials, "max_failures": 3},
                      tracking={"uri": tracking}, train={"epochs": 3})
    gate, mid_gate = tmp_path / "release-trials", tmp_path / "release-after-an-epoch"
    env = {**slurm_env, "SWEEPS_HOLD_TRIAL": str(gate), "SWEEPS_HOLD_MID_TRIAL": str(mid_gate),
           "OMP_NUM_THREADS": "1"}
    proc = run_cli(tmp_path, "slurm", str(spec), "--array", "2", "--cpus-per-task", "1", "--grace", "30",
                   timeout=300, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    try:
        wait_for(lambda: len(running_trials(storage)) == 2, timeout=600, every=0.5,
                 what="a trial running in each array task")
        gate.write_text("go")
        # Preempt task 1 once its trial has reported (and checkpointed) an epoch: it waits there.
        wait_for(lambda: task1_trial_reported(storage, tracking), timeout=600, every=0.5,
                 what="task 1's trial to report an epoch")
        slurm(slurm_env, "scancel", "--batch", "--signal=TERM", f"{job}_1")
        wait_for(lambda: task_state(slurm_env, job, 1) != "RUNNING", timeout=300, every=0.5,
                 what="the preempted task to exit")
        failed = [t for t in pg_study(storage, "slurmy").trials if t.state.name == "FAIL"]
        assert len(failed) == 1, "the signal did not reach the worker: no trial was stopped and requeued"
        stopped = failed[0]
        assert stopped.user_attrs.get("interrupted") is True, stopped.user_attrs
        assert (tmp_path / stopped.user_attrs["out_dir"] / "last.pt").is_file()  # the task ran in tmp_path
        slurm(slurm_env, "scontrol", "requeue", f"{job}_1")
        # Task 0's trial is still held, so the requeued task 1 is the worker that takes the retry.
        wait_for(lambda: any(t.state.name == "RUNNING" and t.system_attrs.get("failed_trial") == stopped.number
                             for t in pg_study(storage, "slurmy").trials), timeout=600, every=0.5,
                 what="the requeued task to take the stopped trial's retry")
        mid_gate.write_text("go")
        wait_for(lambda: not slurm(slurm_env, "squeue", "-h", "-j", job).strip(), timeout=1200, every=1,
                 what="the job array to finish")
    finally:
        subprocess.run(["scancel", job], env={**os.environ, **slurm_env}, timeout=60, check=False)

    script = (tmp_path / "runs" / "slurm" / "slurmy.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@30" in script and "#SBATCH --requeue" in script, script
    logs = {p.name: p.read_text() for p in (tmp_path / "runs" / "slurm" / "logs").iterdir()}
    task1 = next(text for name, text in logs.items() if name.endswith("_1.out"))
    assert "restart 0" in task1 and "restart 1" in task1, logs
    for index in (0, 1):
        shown = slurm(slurm_env, "scontrol", "show", "job", f"{job}_{index}")
        assert "JobState=COMPLETED" in shown and "ExitCode=0:0" in shown, (shown, logs)

    study = pg_study(storage, "slurmy")
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == n_trials, states
    assert set(states) == {"COMPLETE", "FAIL"} and states.count("FAIL") == 1, states
    [retry] = [t for t in study.trials if t.system_attrs.get("failed_trial") == stopped.number]
    assert retry.state.name == "COMPLETE" and retry.params == stopped.params

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    run = client.get_run(retry.user_attrs["mlflow_run_id"])
    assert int(run.data.tags.get("sweeps.resumed_from_step", 0)) >= 1, run.data.tags  # from the checkpoint
    assert run.data.tags["sweeps.worker_slot"] == "1", run.data.tags  # by the requeued task
    trial_runs = client.search_runs([run.info.experiment_id], "tags.`sweeps.role` = 'trial'", max_results=100)
    assert sorted(r.info.status for r in trial_runs).count("RUNNING") == 0
    assert len({r.data.tags.get("sweeps.optuna_trial_id") for r in trial_runs}) == len(trial_runs)
