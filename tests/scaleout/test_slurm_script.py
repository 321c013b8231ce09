"""``sweeps slurm`` in-process, without a cluster: the batch script it writes, and bad input refused
with exit 2 before anything is written (the job itself runs in test_slurm.py, marked slurm)."""
from __future__ import annotations

import pytest

from sweeps.cli import main
from tests.sweeps.study_helpers import write_spec

PG = "postgresql://sweeps@db-host:5432/sweeps"


def test_the_script_asks_for_the_array_gpus_signal_and_requeue_and_execs_sweeps(in_tmp, capsys):
    spec = write_spec(in_tmp, name="arr", storage=PG, resources={"devices": "auto", "gpus_per_trial": 1})
    assert main(["slurm", str(spec), "--array", "8", "--gpus-per-task", "2", "--grace", "90", "--time", "04:00:00",
                 "--partition", "gpu", "--sbatch-arg=--account=lab", "--no-submit"]) == 0
    assert "sbatch runs/slurm/arr.sbatch" in capsys.readouterr().out
    script = (in_tmp / "runs" / "slurm" / "arr.sbatch").read_text()
    directives = [ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    assert directives == ["--job-name=sweeps-arr", "--array=0-7", "--ntasks=1", "--cpus-per-task=4",
                          "--signal=B:TERM@90", "--requeue", "--open-mode=append",
                          f"--output={in_tmp}/runs/slurm/logs/%x-%A_%a.out", f"--chdir={in_tmp}",
                          "--gpus-per-task=2", "--time=04:00:00", "--partition=gpu", "--account=lab"]
    commands = [ln.strip() for ln in script.splitlines() if "sweeps.cli" in ln]
    assert len(commands) == 2 and all(c.startswith("exec ") for c in commands), commands  # signals reach sweeps
    assert commands[0].endswith(f"-m sweeps.cli run {spec}")
    # 2 GPUs per task, 1 per trial: the worker fans out over its task's GPUs.
    assert commands[1].endswith(f"-m sweeps.cli worker {spec} --wait 600 --devices auto --gpus-per-trial 1")


@pytest.mark.parametrize("overrides, args, says", [
    ({}, [], "is a local journal file"),
    ({"backend": "ray"}, [], "`sweeps slurm` runs Optuna workers"),
    ({"storage": PG}, ["--grace", "5"], "--grace 5"),
    ({"storage": PG}, ["--array", "0"], "--array 0"),
    ({"storage": PG, "resources": {"devices": "auto", "gpus_per_trial": 2}}, ["--gpus-per-task", "3"],
     "must be a multiple of 2"),
])
def test_bad_input_exits_2_and_writes_nothing(in_tmp, capsys, overrides, args, says):
    spec = write_spec(in_tmp, name="bad", **overrides)
    argv = ["slurm", str(spec), *(args if "--array" in args else ["--array", "2", *args]), "--no-submit"]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not (in_tmp / "runs" / "slurm").exists()


def test_without_sbatch_it_says_how_to_submit(in_tmp, capsys, monkeypatch):
    spec = write_spec(in_tmp, name="nosb", storage=PG)
    monkeypatch.setenv("PATH", str(in_tmp))  # no sbatch here
    assert main(["slurm", str(spec), "--array", "2"]) == 2
    err = capsys.readouterr().err
    assert "sbatch is not on PATH" in err and "runs/slurm/nosb.sbatch" in err
