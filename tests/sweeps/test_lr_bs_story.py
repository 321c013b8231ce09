"""`make run` answers its question: the shipped ``studies/lr_bs.yaml``, run as it is (in a tmp
folder), completes enough trials to draw the lr x batch-size landscape and the importances, and
finds a model at >= 98% val accuracy; its guided trials beat its random start."""
from __future__ import annotations

import os
import shutil

import pytest
import yaml

from tests.sweeps.study_helpers import ROOT, load_study, run_cli, save_spec

pytestmark = pytest.mark.slow

SPEC = ROOT / "studies" / "lr_bs.yaml"


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped study run once as it is (its own sampler seed), in a tmp folder: the folder.
    Both tests read it; the second runs only the other seeds."""
    folder = tmp_path_factory.mktemp("lr_bs")
    path = save_spec(folder, yaml.safe_load(SPEC.read_text()))  # the same study; runs/ lands in folder
    shutil.copyfile(SPEC, path)  # byte for byte, comments included
    proc = run_cli(folder, "run", str(path), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder


def test_shipped_lr_bs_study_completes_several_trials_and_draws_its_importances(shipped):
    from dashboards.tables import build_tables
    from sweeps.backends.by_name import get_backend
    from sweeps.spec.load import load_spec

    tmp_path = shipped
    spec_dict = yaml.safe_load(SPEC.read_text())
    path = tmp_path / SPEC.name

    trials = load_study(tmp_path, "lr_bs").trials
    states = [t.state.name for t in trials]
    assert len(trials) == spec_dict["budget"]["n_trials"] and set(states) == {"COMPLETE"}  # no pruner

    before = os.getcwd()
    os.chdir(tmp_path)
    try:
        spec = load_spec(path)
        result = get_backend(spec.backend).load(spec)
    finally:
        os.chdir(before)
    tables = build_tables(result, spec.search, reader=None)
    best = tables.best_row()
    assert best is not None and best["value"] >= 0.98
    # The landscape: completed trials at several lr and at least two batch sizes.
    complete = tables.trials[tables.trials["state"] == "COMPLETE"]
    assert complete["lr"].nunique() >= 4 and complete["batch_size"].nunique() >= 2
    assert set(tables.importances["param"]) == {"lr", "batch_size"}
    assert tables.importances["importance"].sum() == pytest.approx(1.0)
    assert tables.importance_note.startswith(f"from {len(complete)} completed trials")


def _objective(trial) -> float | None:
    """A trial's objective as the report plots it: its value, or a pruned trial's best reported epoch."""
    if trial.state.name == "COMPLETE":
        return trial.value
    if trial.state.name == "PRUNED" and trial.intermediate_values:
        return max(trial.intermediate_values.values())
    return None


def test_guided_trials_of_the_shipped_lr_bs_match_its_random_start_over_three_seeds(shipped, tmp_path):
    """Over 3 sampler seeds, the median objective of the trials the sampler guided is at least the
    median of the random trials it started with (pooled over the seeds). At 3 epochs most points of
    this space reach 97-98%, and two workers finish trials in an order that varies, so the guided
    median is level with the random one or above it, not reliably above (per seed it is above,
    below or level). The study of the shipped seed is the one the test above reads, not run again."""
    import statistics

    spec_dict = yaml.safe_load(SPEC.read_text())
    startup = spec_dict["sampler"]["n_startup_trials"]
    shipped_seed = spec_dict["sampler"]["seed"]
    random_values, guided_values, per_seed = [], [], []
    for seed in (0, 1, 2):
        folder = shipped if seed == shipped_seed else tmp_path / f"seed{seed}"
        if seed != shipped_seed:
            spec_dict["sampler"]["seed"] = seed
            path = save_spec(folder, spec_dict)
            proc = run_cli(folder, "run", str(path), "--quiet")
            assert proc.returncode == 0, proc.stdout + proc.stderr
        trials = [t for t in load_study(folder, "lr_bs").trials if _objective(t) is not None]
        rnd = [_objective(t) for t in trials if t.number < startup]
        guided = [_objective(t) for t in trials if t.number >= startup]
        per_seed.append((statistics.median(rnd), statistics.median(guided)))
        random_values += rnd
        guided_values += guided
    assert statistics.median(guided_values) >= statistics.median(random_values), per_seed
