"""Commands for running a study beyond one machine: ``sweeps doctor SPEC``, a worker machine's
preflight (sweeps/doctor.py)."""
from __future__ import annotations

import argparse
import time

from sweeps.commands.base import Command, console, err_console, load_spec_file


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


COMMANDS = (
    Command("doctor", "check what a worker on this machine needs: storage, MLflow server, Host header, "
            "permissions, artifacts, GPUs, versions (one line each; exit 2 on a problem)", _doctor_args, cmd_doctor),
)
