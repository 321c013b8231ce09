"""``sweeps check SPEC``: sanity checks before a sweep, on CPU, in seconds (core/sanity.py).

It builds the task and the model for the first point of the search space (each float or int at
its low end, each categorical at its first choice), runs one forward and backward, overfits one
small batch and checks the data pipeline. Every finding is printed; any problem exits 2.
"""
from __future__ import annotations

# Each command imports what it runs inside its own function, lazily for start-up: `sweeps --help`
# and every other command load none of it (torch, MLflow, Optuna, pandas).
import argparse
import time
from typing import Any

from sweeps.commands.base import Command, console, err_console, load_spec_file
from sweeps.errors import SpecError, UsageError


def _check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="study spec YAML file")
    p.add_argument("--steps", type=int, default=None, metavar="N",  # None: core.sanity.OVERFIT_STEPS
                   help="optimizer steps the overfit check may take (default: 500)")
    p.add_argument("--factor", type=float, default=10.0, metavar="F",
                   help="the overfit check passes once the loss on one batch falls F times (default: 10)")


def first_point(search: dict[str, Any]) -> dict[str, Any]:
    """The search space's first point: a range's low end, a categorical's first choice."""
    from sweeps.spec.search_space import CategoricalParam

    return {key: p.choices[0] if isinstance(p, CategoricalParam) else p.low for key, p in search.items()}


def cmd_check(a: argparse.Namespace) -> int:
    from core.config import ConfigError, apply_overrides
    from core.sanity import OVERFIT_STEPS, sanity_check
    from core.tasks.base import TaskError
    steps = OVERFIT_STEPS if a.steps is None else a.steps
    if steps < 1 or not a.factor > 1:
        raise UsageError(f"--steps {steps} --factor {a.factor}: use --steps 1 or more and --factor above 1")
    started = time.monotonic()
    spec = load_spec_file(a.spec)
    params = first_point(spec.search)
    try:
        task = spec.make_task(params)
        # On CPU: the check is about the code and the data, and must not wait for a GPU.
        cfg = apply_overrides(spec.resolved_train_config(params), {"device": "cpu"})
    except (TaskError, ConfigError) as exc:
        raise SpecError(a.spec, [f"{exc} (at the search space's first point {params})"]) from None
    findings = sanity_check(task, cfg, steps=steps, factor=a.factor)
    for f in findings:
        (console if f.ok else err_console).print(f"{'ok     ' if f.ok else 'PROBLEM'} {f.check:<10} {f.message}",
                                                 markup=False, highlight=False)
    problems = sum(not f.ok for f in findings)
    seconds = time.monotonic() - started
    if problems:
        err_console.print(f"{a.spec}: {problems} problem{'s' if problems != 1 else ''} found in {seconds:.1f} s "
                          f"(task {spec.task.name or spec.task.target!r}, point {params}); fix them before the "
                          f"sweep", markup=False, highlight=False)
        return 2
    console.print(f"{a.spec}: ok in {seconds:.1f} s (task {spec.task.name or spec.task.target!r}, point {params})",
                  markup=False, highlight=False)
    return 0


COMMANDS = (
    Command("check", "sanity-check a spec's task before a sweep: one forward/backward, overfit one batch, "
            "the data pipeline (exit 2 on a problem)", _check_args, cmd_check),
)
