"""What ``sweeps run`` says and exits with when a study stops short of its budget.

One place for both backends (Optuna's supervisor and the Ray driver), so that a script or a
CI job reads the same exit code and the same message whichever backend ran the study:
0 when the budget finished (or ``budget.timeout`` ended this invocation, which the next
``sweeps run`` continues), 128 + the signal's number after a signal, 1 otherwise, and 1 when every
trial ended without a result (pruned, failed or rejected: nothing to compare or promote).
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sweeps.backends.base import StudyResult

EXIT_BUDGET_UNMET = 1
REASONS_SHOWN = 3  # the most common end reasons named when no trial completed


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


def no_trial_completed(result: StudyResult, spec_path: object) -> str | None:
    """Why the study has no result although every trial of it has ended (none is running or
    waiting to resume), or None when one completed: every trial pruned (diverged, say), failed or
    rejected leaves nothing to compare or promote, which an exit code of 0 would hide. The most
    common end reasons are named, each with its count."""
    ended = [t for t in result.trials if t.state in ("PRUNED", "FAIL")]
    if not ended or any(t.state not in ("PRUNED", "FAIL") for t in result.trials):
        return None
    reasons = Counter(f"{t.state.lower()}: {(t.reason or 'no reason recorded').splitlines()[0][:160]}"
                      for t in ended)
    named = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(REASONS_SHOWN))
    more = f"; and {len(reasons) - REASONS_SHOWN} other reasons" if len(reasons) > REASONS_SHOWN else ""
    return (f"no trial of study {result.name!r} completed: all {len(ended)} ended without a result ({named}{more}); "
            f"nothing to compare or promote. See each trial's reason with `sweeps status {spec_path}`")
