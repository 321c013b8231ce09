"""One meaning for a trial's value: the objective at its best epoch (the checkpoint promote
registers), the same in ``sweeps status``, the run's output, the report's tables and the MLflow
``objective`` metric, for completed and pruned trials alike.

The study is built so that a pruned trial's last epoch is worse than its best one (Optuna's own
value of a pruned trial is its LAST intermediate value): a learning rate of 3 on the digits MLP
scores about 0.108 after epoch 1 and 0.097 after epoch 2, where the median pruner stops it.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from tests.sweeps.study_helpers import cli_in_process, load_study, mlflow_runs, write_spec

pytestmark = pytest.mark.slow

LRS = (0.05, 0.8, 3.0)  # two completed trials (the median pruner's start-up), then one it prunes


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    root = tmp_path_factory.mktemp("value-agrees")
    spec = write_spec(root, name="agree", train={"epochs": 3},
                      search={"lr": {"type": "float", "low": 0.01, "high": 5.0, "log": True}},
                      pruner={"name": "median", "warmup_epochs": 2}, budget={"n_trials": len(LRS)})
    (root / "runs").mkdir(exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(root / "runs" / "agree.journal")))
    queued = optuna.create_study(study_name="agree", storage=storage, direction="maximize")
    for lr in LRS:  # `sweeps run` takes queued trials first, in order
        queued.enqueue_trial({"lr": lr}, skip_if_exists=False)
    proc = cli_in_process(root, "run", str(spec))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, spec, proc.stdout


def _best_epoch_values(root) -> dict[int, float]:
    """trial number -> the objective at its best epoch, from the study's stored epochs."""
    trials = load_study(root, "agree").trials
    return {t.number: max(t.intermediate_values.values()) for t in trials}


def test_the_study_has_a_pruned_trial_whose_last_epoch_is_not_its_best(study):
    root, _, _ = study
    trials = {t.number: t for t in load_study(root, "agree").trials}
    assert [trials[n].state.name for n in sorted(trials)] == ["COMPLETE", "COMPLETE", "PRUNED"]
    pruned = trials[2]
    last = pruned.intermediate_values[max(pruned.intermediate_values)]
    assert pruned.value == last and last < max(pruned.intermediate_values.values()), \
        f"the premise of these tests changed: trial 2's epochs {pruned.intermediate_values}"


def test_status_report_and_mlflow_agree_on_every_trial_value(study):
    from dashboards.tables import build_tables
    from sweeps.backends.by_name import get_backend
    from sweeps.spec.load import load_spec

    root, spec_path, run_output = study
    expected = _best_epoch_values(root)

    status = cli_in_process(root, "status", str(spec_path), "--format", "json")
    assert status.returncode == 0, status.stdout + status.stderr
    status_values = {r["number"]: r["value"] for r in json.loads(status.stdout)["trials"]}

    printed = {int(n): float(v) for n, v in re.findall(r"^trial (\d+) \w+ val_acc=([0-9.]+)", run_output, re.M)}

    runs = mlflow_runs(root, "agree")
    trial_runs = [r for r in runs if r.data.tags.get("sweeps.role") == "trial"]
    mlflow_values = {int(r.data.tags["sweeps.trial_number"]): r.data.metrics["objective"] for r in trial_runs}

    before = os.getcwd()
    os.chdir(root)  # the spec's runs/ paths are relative to the working directory
    try:
        spec = load_spec(spec_path)
        result = get_backend(spec.backend).load(spec)
    finally:
        os.chdir(before)
    table = build_tables(result, spec.search, reader=None).trials
    report_values = dict(zip(table["number"], table["value"], strict=True))

    assert set(status_values) == set(mlflow_values) == set(report_values) == set(printed) == {0, 1, 2}
    for n, value in expected.items():
        assert status_values[n] == pytest.approx(value, abs=1e-6), f"status, trial {n}"
        assert report_values[n] == pytest.approx(value, abs=1e-6), f"report, trial {n}"
        assert mlflow_values[n] == pytest.approx(value, abs=1e-6), f"MLflow objective, trial {n}"
        assert printed[n] == pytest.approx(value, abs=5e-5), f"run output, trial {n}"
