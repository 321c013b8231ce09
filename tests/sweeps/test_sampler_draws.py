"""`sweeps run` draws trial n's parameters from (sampler.seed, n), whichever invocation asks:
more budget never repeats the points already drawn, and the same spec run again from scratch
draws the same points (the real CLI, journal storage)."""
from __future__ import annotations

import pytest

from tests.sweeps.study_helpers import cli_in_process, load_study, write_spec

pytestmark = pytest.mark.slow

TPE = {"name": "tpe", "seed": 0}  # the default sampler, where the repeats were reported


def _run(cwd, n_trials: int):
    spec = write_spec(cwd, name="draws", sampler=TPE, budget={"n_trials": n_trials})
    proc = cli_in_process(cwd, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _drawn(cwd) -> list[dict]:
    trials = sorted(load_study(cwd, "draws").trials, key=lambda t: t.number)
    assert all(t.state.name == "COMPLETE" for t in trials), [(t.number, t.state.name) for t in trials]
    return [t.params for t in trials]


def test_more_budget_draws_new_points_instead_of_repeating_the_first_ones(tmp_path):
    _run(tmp_path, 2)
    _run(tmp_path, 4)  # the same spec with more budget: a new process, a new sampler
    drawn = _drawn(tmp_path)
    assert len(drawn) == 4 and len({d["lr"] for d in drawn}) == 4, drawn


def test_the_same_spec_from_scratch_draws_the_same_points(tmp_path):
    for folder in ("a", "b"):
        _run(tmp_path / folder, 3)
    assert _drawn(tmp_path / "a") == _drawn(tmp_path / "b")
