"""What ``sweeps run`` says and exits with when a study stops short of its budget.

One place for both backends (Optuna's supervisor and the Ray driver), so that a script or a
CI job reads the same exit code and the same message whichever backend ran the study:
0 when the budget finished (or ``budget.timeout`` ended this invocation, which the next
``sweeps run`` continues), 128 + the signal's number after a signal, 1 otherwise.
"""
from __future__ import annotations

EXIT_BUDGET_UNMET = 1


def max_failures_stop(max_failures: int) -> tuple[str, int]:
    """``budget.max_failures`` trials failed in a row: the study stops."""
    return f"stopped: {max_failures} trials failed in a row (budget.max_failures)", EXIT_BUDGET_UNMET


def unfinished_stop(done: int, total: int, failed: int, spec_path: object) -> tuple[str, int]:
    """Nothing is left to run in this invocation, yet fewer than ``total`` trials finished
    (the rest failed): the exit code must not say the budget finished."""
    return (f"stopped with {done} of {total} trials finished: {failed} failed; see the reasons with "
            f"`sweeps status {spec_path}`; the next sweeps run retries them", EXIT_BUDGET_UNMET)


def failures_in_a_row(states: list[str]) -> int:
    """How many trials failed in a row at the end of ``states`` (trial end states in the
    order the trials ended): a COMPLETE or PRUNED trial resets the count."""
    count = 0
    for state in states:
        count = count + 1 if state == "FAIL" else 0
    return count
