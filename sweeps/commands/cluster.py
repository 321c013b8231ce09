"""Commands for running a study beyond one machine: ``sweeps doctor SPEC``, a worker machine's
preflight (sweeps/doctor.py), and ``sweeps slurm SPEC``, a SLURM job array of the study
(sweeps/slurm.py)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from sweeps.commands import Command, console, err_console, load_spec_file


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file")
    p.add_argument("--expect-gpus", type=int, default=None, metavar="N",
                   help="a problem unless at least N GPUs are visible (default: those resources.devices names)")


def cmd_doctor(a: argparse.Namespace) -> int:
    from sweeps.doctor import PROBLEM, run_checks
    from sweeps.errors import UsageError

    if a.expect_gpus is not None and a.expect_gpus < 0:
        raise UsageError(f"--expect-gpus {a.expect_gpus}: use 0 or more")
    started = time.monotonic()
    spec = load_spec_file(a.spec)
    problems = 0
    for check in run_checks(spec, a.expect_gpus):
        problems += check.verdict == PROBLEM
        (err_console if check.verdict == PROBLEM else console).print(
            f"{check.verdict:<7} {check.name:<10} {check.message}", markup=False, highlight=False)
    seconds = time.monotonic() - started
    if problems:
        err_console.print(f"{a.spec}: {problems} problem{'s' if problems != 1 else ''} in {seconds:.1f} s: a worker "
                          "here would fail; fix them first", markup=False, highlight=False)
        return 2
    console.print(f"{a.spec}: a worker can run here ({seconds:.1f} s)", markup=False, highlight=False)
    return 0


def _slurm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file (storage: a postgresql:// URL every node reaches)")
    p.add_argument("--array", type=int, required=True, metavar="N",
                   help="array tasks: task 0 runs `sweeps run SPEC`, tasks 1..N-1 `sweeps worker SPEC`")
    p.add_argument("--gpus-per-task", type=int, default=0, metavar="K", help="GPUs per task (default: 0, CPU)")
    p.add_argument("--cpus-per-task", type=int, default=4, metavar="C", help="CPUs per task (default: 4)")
    p.add_argument("--grace", type=int, default=120, metavar="SECONDS",
                   help="SIGTERM this long before the time limit (--signal=B:TERM@SECONDS; default: 120)")
    p.add_argument("--time", default=None, help="sbatch --time (e.g. 04:00:00)")
    p.add_argument("--partition", default=None, help="sbatch --partition")
    p.add_argument("--mem", default=None, help="sbatch --mem per task (e.g. 32G)")
    p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                   help="how long a worker task waits for task 0 to create the study (default: 600)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="another sbatch option, as given (repeatable), e.g. --sbatch-arg=--account=lab")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to write the script (default: runs/slurm/<study>.sbatch; logs in runs/slurm/logs/)")
    p.add_argument("--no-submit", action="store_true", help="write the script only; submit it with sbatch FILE")


def cmd_slurm(a: argparse.Namespace) -> int:
    from sweeps.slurm import SlurmJob, submit, write_script

    spec = load_spec_file(a.spec)
    job = SlurmJob(tasks=a.array, gpus_per_task=a.gpus_per_task, cpus_per_task=a.cpus_per_task, grace_s=a.grace,
                   time=a.time, partition=a.partition, mem=a.mem, wait_s=a.wait, sbatch_args=tuple(a.sbatch_arg))
    job.check(spec)
    out = Path(a.out) if a.out else Path("runs") / "slurm" / f"{spec.name}.sbatch"
    script = write_script(job, spec, Path(a.spec).absolute(), out, Path.cwd())
    if a.no_submit:
        console.print(f"wrote {script}; submit it with: sbatch {script}", markup=False, highlight=False)
        return 0
    job_id = submit(script)
    console.print(f"submitted job {job_id} ({a.array} task{'s' if a.array != 1 else ''}) from {script}; logs in "
                  f"{script.parent.absolute() / 'logs'}; follow it with: squeue -j {job_id} and sweeps status {a.spec}",
                  markup=False, highlight=False)
    return 0


COMMANDS = (
    Command("doctor", "check what a worker on this machine needs: storage, MLflow server, Host header, "
            "permissions, artifacts, GPUs, versions (one line each; exit 2 on a problem)", _doctor_args, cmd_doctor),
    Command("slurm", "write and submit a SLURM job array of the study: task 0 runs it, the others join as workers "
            "(preemption-safe: SIGTERM checkpoints and requeues)", _slurm_args, cmd_slurm),
)
