"""The plain (non-terminal) view of ``sweeps run``: one line per ended trial, each counted."""
from __future__ import annotations

import re

from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.live import LiveView
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import tiny_spec


def _trial(number: int, state: str, value: float | None = None) -> TrialRecord:
    return TrialRecord(number, state, {"lr": 0.1}, value, 1.0, None, reason="failed: boom" if state == "FAIL" else "")


def _poll(view: LiveView, trials: list[TrialRecord]) -> None:
    view.update_result(StudyResult("tiny", "optuna", "maximize", "val_acc", trials))


def test_each_line_counts_the_trials_that_used_the_budget(capsys):
    view = LiveView(spec_from_dict(tiny_spec(budget={"n_trials": 5})), "tiny", quiet=True)
    done = [_trial(0, "COMPLETE", 0.9), _trial(1, "RUNNING")]
    _poll(view, done)
    # Three trials ended between two polls, one of them failed (a failure does not use the budget).
    done = [_trial(0, "COMPLETE", 0.9), _trial(1, "PRUNED", 0.5), _trial(2, "FAIL"), _trial(3, "COMPLETE", 0.8)]
    _poll(view, done)
    _poll(view, done)  # nothing new: nothing printed
    _poll(view, done + [_trial(4, "COMPLETE", 0.7)])
    lines = capsys.readouterr().out.splitlines()
    counts = [(int(m[1]), m[2], m[3]) for m in (re.match(r"trial (\d+) (\w+) .*\[(\d+)/5\]", x) for x in lines)]
    assert counts == [(0, "COMPLETE", "1"), (1, "PRUNED", "2"), (2, "FAIL", "2"), (3, "COMPLETE", "3"),
                      (4, "COMPLETE", "4")]
    assert "(failed: boom)" in lines[2]
