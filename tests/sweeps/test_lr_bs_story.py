"""`make run` answers its question: the shipped ``studies/lr_bs.yaml``, run as it is (in a tmp
folder), completes enough trials to draw the lr x batch-size landscape and the importances, and
finds a model at >= 98% val accuracy. How its guided trials compare with its random start is a
measurement over seeds (benchmarks/), not an assertion: at 3 epochs most of this space reaches
97-98%, so the two medians lie within a point of each other and their order varies with the order
in which two workers finish trials."""
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
    """The shipped study run once as it is (its own sampler seed), in a tmp folder: the folder."""
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
