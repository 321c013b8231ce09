"""`make run` answers its question: the shipped ``studies/lr_bs.yaml``, run as it is (in a tmp
folder), completes enough trials to draw the lr x batch-size landscape and the importances, and
finds a model at >= 98% val accuracy. Its pruner once let 1 of 12 trials finish."""
from __future__ import annotations

import os
import shutil

import pytest
import yaml

from tests.sweeps.study_helpers import ROOT, load_study, run_cli, save_spec

pytestmark = pytest.mark.slow

SPEC = ROOT / "studies" / "lr_bs.yaml"


def test_shipped_lr_bs_study_completes_several_trials_and_draws_its_importances(tmp_path):
    from dashboards.tables import build_tables
    from sweeps.backends.by_name import get_backend
    from sweeps.spec_checks import load_spec

    spec_dict = yaml.safe_load(SPEC.read_text())
    path = save_spec(tmp_path, spec_dict)  # the same study; runs/ lands in tmp_path
    shutil.copyfile(SPEC, path)  # byte for byte, comments included
    proc = run_cli(tmp_path, "run", str(path), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    trials = load_study(tmp_path, "lr_bs").trials
    states = [t.state.name for t in trials]
    assert len(trials) == spec_dict["budget"]["n_trials"] and set(states) <= {"COMPLETE", "PRUNED"}
    assert states.count("COMPLETE") >= 4, f"only {states.count('COMPLETE')} of {len(trials)} trials completed"
    assert "PRUNED" in states  # the pruner still stops the hopeless trials

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
