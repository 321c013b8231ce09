"""A study in which no trial completes exits non-zero saying why (it exited 0 when every trial was
pruned), and NaN in the training data fails its trials as a data problem instead of pruning them
as "diverged: non-finite loss"."""
from __future__ import annotations

import pytest

from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.backends.driver import no_trial_completed
from tests.sweeps.study_helpers import cli_in_process, load_study, write_spec


def _result(*ended: tuple[str, str]) -> StudyResult:
    trials = [TrialRecord(i, state, {}, None, 1.0, None, reason=reason) for i, (state, reason) in enumerate(ended)]
    return StudyResult("s", "optuna", "maximize", "val_acc", trials)


def test_no_trial_completed_names_the_most_common_reasons_or_is_none():
    pruned = ("PRUNED", "diverged: non-finite loss nan at step 1 (epoch 1)")
    message = no_trial_completed(_result(pruned, pruned, ("FAIL", "DataError: bad\nmore"), pruned), "s.yaml")
    assert message == ("no trial of study 's' completed: all 4 ended without a result (3 x pruned: diverged: "
                       "non-finite loss nan at step 1 (epoch 1); 1 x fail: DataError: bad); nothing to compare or "
                       "promote. See each trial's reason with `sweeps status s.yaml`")
    many = no_trial_completed(_result(*[("FAIL", f"reason {i}") for i in range(5)]), "s.yaml")
    assert many is not None and "; and 2 other reasons)" in many
    assert no_trial_completed(_result(pruned, ("COMPLETE", "")), "s.yaml") is None
    assert no_trial_completed(_result(pruned, ("WAITING", "interrupted")), "s.yaml") is None  # resumed next run
    assert no_trial_completed(_result(), "s.yaml") is None


@pytest.mark.slow
def test_a_study_whose_every_trial_diverges_exits_non_zero_saying_why(tmp_path):
    task = {"name": None, "target": "tests.sweeps.check_tasks:always_diverges", "model": "mlp", "args": {}}
    spec = write_spec(tmp_path, name="diverging", task=task, budget={"n_trials": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: no trial of study 'diverging' completed: all 2 ended without a result (2 x pruned: diverged: " \
           "non-finite loss nan at step 1 (epoch 1)" in proc.stderr, proc.stderr
    assert [t.state.name for t in load_study(tmp_path, "diverging").trials] == ["PRUNED", "PRUNED"]


@pytest.mark.slow
def test_nan_in_the_training_data_fails_each_trial_as_a_data_problem(tmp_path):
    task = {"name": None, "target": "tests.sweeps.check_tasks:nan_inputs", "model": "mlp", "args": {}}
    spec = write_spec(tmp_path, name="nandata", task=task, budget={"n_trials": 2, "max_failures": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stopped: 2 trials failed in a row" in proc.stdout + proc.stderr
    study = load_study(tmp_path, "nandata")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    assert study.trials[0].user_attrs["fail_reason"].startswith(
        "DataError: task 'digits': its train dataset (digits-train) holds 4 NaN or infinite values (4 in its inputs), "
        "in 3 of its 1437 samples")
