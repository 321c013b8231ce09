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


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """A study run with a budget of 2, then the same spec with a budget of 4 (a new process, a new
    sampler): its folder."""
    folder = tmp_path_factory.mktemp("grown")
    _run(folder, 2)
    _run(folder, 4)
    return folder


def test_more_budget_draws_new_points_instead_of_repeating_the_first_ones(grown):
    drawn = _drawn(grown)
    assert len(drawn) == 4 and len({d["lr"] for d in drawn}) == 4, drawn


def test_the_same_spec_from_scratch_draws_the_same_points(grown, tmp_path):
    """The same spec run once from scratch with the whole budget draws the points the grown study
    drew over its two invocations: trial n's point depends on (sampler.seed, n) alone."""
    _run(tmp_path, 4)
    assert _drawn(tmp_path) == _drawn(grown)
