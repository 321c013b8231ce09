"""A study on a SLURM cluster: one job array whose task 0 runs ``sweeps run SPEC`` (it creates the
study and its MLflow parent run, trains, and writes the summary) and whose other tasks run
``sweeps worker SPEC``, all on the spec's PostgreSQL storage.

Each task ``exec``\\ s its command, so the process SLURM signals is the sweeps process itself: with
``--signal=B:TERM@<grace>`` (before a time limit) and on preemption or ``scancel --batch
--signal=TERM``, the running trial saves a checkpoint, is failed as interrupted and requeued in the
study, and the process exits. ``--requeue`` lets SLURM put the task back in the queue; the task
that starts again joins the study and takes the requeued trial, which resumes from its
checkpoint when ``runs/`` is on a file system every node shares. GPUs come from SLURM's
allocation (``--gpus-per-task``): SLURM sets ``CUDA_VISIBLE_DEVICES`` for the task and the
worker uses what it sees. Secrets never enter the script: ``sbatch`` passes the submitting
shell's environment (``PGPASSWORD``, ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``) to the tasks.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sweeps.errors import SweepsError, UsageError
from sweeps.spec.model import StudySpec

MIN_GRACE_S = 10  # a trial needs a few seconds to write its checkpoint and requeue itself


class SlurmError(SweepsError):
    """sbatch is missing or refused the job: SLURM's own message, exit 2 (nothing was queued)."""

    exit_code = 2


@dataclass(frozen=True)
class SlurmJob:
    """What ``sweeps slurm`` asks SLURM for: ``tasks`` array tasks of ``gpus_per_task`` GPUs and
    ``cpus_per_task`` CPUs each, ``grace_s`` seconds of warning before a time limit, and any
    ``sbatch_args`` passed on as given (``--account=...``, ``--qos=...``, ``--constraint=...``)."""

    tasks: int
    gpus_per_task: int = 0
    cpus_per_task: int = 4
    grace_s: int = 120
    time: str | None = None
    partition: str | None = None
    mem: str | None = None
    wait_s: float = 600.0
    sbatch_args: tuple[str, ...] = field(default_factory=tuple)

    def check(self, spec: StudySpec) -> None:
        """UsageError (exit 2) naming the flag, the value and the fix; nothing is written before."""
        if spec.backend != "optuna":
            raise UsageError(f"{spec.path}: backend: {spec.backend!r}; `sweeps slurm` runs Optuna workers. For Ray "
                             "on SLURM start a Ray cluster inside one job (docs/SCALE_OUT.md, SLURM)")
        if not spec.is_rdb_storage():
            raise UsageError(f"{spec.path}: storage: {spec.storage_url()!r} is a local journal file; the tasks of a "
                             "job array run on several nodes and need shared storage such as "
                             "postgresql://user@db-host:5432/sweeps")
        if self.tasks < 1:
            raise UsageError(f"--array {self.tasks}: use 1 or more tasks (task 0 runs `sweeps run`)")
        if self.gpus_per_task < 0 or self.cpus_per_task < 1:
            raise UsageError(f"--gpus-per-task {self.gpus_per_task} --cpus-per-task {self.cpus_per_task}: use 0 or "
                             "more GPUs and 1 or more CPUs")
        per_trial = spec.resources.gpus_per_trial
        if self.gpus_per_task and per_trial >= 1 and self.gpus_per_task % int(per_trial):
            raise UsageError(f"--gpus-per-task {self.gpus_per_task}: resources.gpus_per_trial is {per_trial:g}, so a "
                             f"task's GPUs must be a multiple of {per_trial:g}")
        if self.grace_s < MIN_GRACE_S:
            raise UsageError(f"--grace {self.grace_s}: give a trial at least {MIN_GRACE_S} s to checkpoint and requeue")

    def directives(self, name: str, log_dir: Path, workdir: Path) -> list[str]:
        lines = [f"--job-name=sweeps-{name}", f"--array=0-{self.tasks - 1}", "--ntasks=1",
                 f"--cpus-per-task={self.cpus_per_task}", f"--signal=B:TERM@{self.grace_s}", "--requeue",
                 "--open-mode=append", f"--output={log_dir}/%x-%A_%a.out", f"--chdir={workdir}"]
        if self.gpus_per_task:
            lines.append(f"--gpus-per-task={self.gpus_per_task}")
        lines += [f"--{key}={value}" for key, value in
                  (("time", self.time), ("partition", self.partition), ("mem", self.mem)) if value]
        return [*lines, *self.sbatch_args]


def task_command(job: SlurmJob, spec: StudySpec, spec_path: Path) -> str:
    """The shell line each task execs: ``sweeps run`` for task 0, ``sweeps worker`` for the others.
    A task with more GPUs than a trial takes fans out over them (``--devices auto``)."""
    sweeps = f"{shlex.quote(sys.executable)} -m sweeps.cli"
    spec_arg = shlex.quote(str(spec_path))
    worker = f"{sweeps} worker {spec_arg} --wait {job.wait_s:g}"
    if job.gpus_per_task > max(1.0, spec.resources.gpus_per_trial):
        worker += f" --devices auto --gpus-per-trial {spec.resources.gpus_per_trial:g}"
    else:
        worker += ' --slot "$SLURM_ARRAY_TASK_ID"'
    return f'if [ "$SLURM_ARRAY_TASK_ID" = 0 ]; then\n  exec {sweeps} run {spec_arg}\nfi\nexec {worker}'


def job_script(job: SlurmJob, spec: StudySpec, spec_path: Path, log_dir: Path, workdir: Path) -> str:
    """The batch script: directives, then ``exec`` of the task's sweeps command (so SLURM's
    signals reach it: a signal to the batch shell would not reach a child it waits for)."""
    lines = job.directives(spec.name, log_dir, workdir)
    head = "\n".join(f"#SBATCH {shlex.quote(d) if ' ' in d else d}" for d in lines)
    return (f"#!/bin/bash\n# Written by `sweeps slurm` for study {spec.name!r}: task 0 runs the study, the others "
            f"join it as workers.\n{head}\nset -euo pipefail\n"
            "echo \"sweeps: task $SLURM_ARRAY_TASK_ID of job $SLURM_ARRAY_JOB_ID on $(hostname), "
            "restart ${SLURM_RESTART_COUNT:-0}, GPUs ${CUDA_VISIBLE_DEVICES:-none}\"\n"
            f"{task_command(job, spec, spec_path)}\n")


def write_script(job: SlurmJob, spec: StudySpec, spec_path: Path, out: Path, workdir: Path) -> Path:
    """Write the script to ``out`` (its log folder beside it) and return its path."""
    log_dir = out.parent.absolute() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(job_script(job, spec, spec_path, log_dir, workdir), encoding="utf-8")
    out.chmod(0o755)
    return out


def submit(script: Path) -> str:
    """``sbatch --parsable`` the script; the job id. SlurmError with SLURM's message when refused."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SlurmError(f"sbatch is not on PATH: run `sbatch {script}` on a machine of the cluster, or "
                         "`sweeps slurm ... --no-submit` to write the script only") from None
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
        raise SlurmError(f"sbatch refused {script}: {reason}")
    return done.stdout.strip().split(";", 1)[0]
