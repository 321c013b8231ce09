"""A local Optuna worker that ``sweeps run`` starts (or restarts, after a worker died) while the
MLflow server is down trains its trials and keeps their runs in the spool, nested under the study's
run, like the workers that were already training: its go names the parent run whole (id,
experiment, name), so it reads nothing from the store to start. In-process: the worker loop of
``python -m sweeps.backends.optuna_worker`` against a tracking URI on which nothing listens."""
from __future__ import annotations

from optuna.trial import TrialState

from sweeps.backends import optuna_attrs, optuna_study
from sweeps.backends.optuna_worker import run_worker
from sweeps.backends.worker_protocol import WorkerGo
from sweeps.spec.load import load_spec
from sweeps.tracking.layout import PARENT_TAG
from sweeps.tracking.mlflow_tracker import DEFAULT_SPOOL_DIR
from sweeps.tracking.spool import Spool
from tests.sweeps.study_helpers import write_spec

PARENT_ID, EXPERIMENT_ID = "0123456789abcdef0123456789abcdef", "7"  # made by `sweeps run` before the outage


def test_a_worker_started_during_an_mlflow_outage_trains_and_spools_its_trial_under_the_parent(
        tmp_path, free_port, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(write_spec(tmp_path, name="outage", storage=f"sqlite:///{tmp_path}/optuna.db",
                                tracking={"uri": f"http://127.0.0.1:{free_port}"}, train={"epochs": 1},
                                budget={"n_trials": 1, "max_failures": 1},
                                resources={"devices": "cpu", "workers": 1}))
    study = optuna_study.open_study(spec)
    go = WorkerGo(spec_text=spec.text or "", spec_path=str(spec.path), study_name=study.study_name,
                  study_uid=study.user_attrs[optuna_attrs.ATTR_STUDY_UID], parent_run_id=PARENT_ID,
                  parent_experiment_id=EXPERIMENT_ID, parent_run_name="outage", since=0.0, deadline=None,
                  slot=0, threads=1, beat_file=str(tmp_path / "beat"))

    assert run_worker(spec, 0, go=WorkerGo.from_line(go.to_line())) == 0

    [trial] = study.get_trials(deepcopy=False)
    assert trial.state == TrialState.COMPLETE
    run_id = trial.user_attrs[optuna_attrs.ATTR_RUN_ID]
    records = [record for _, record in Spool(tmp_path / DEFAULT_SPOOL_DIR).read_pending(run_id)[0]]
    kind, experiment_id, _name, tags = records[0]
    assert (kind, experiment_id, tags[PARENT_TAG]) == ("new", EXPERIMENT_ID, PARENT_ID)
    assert {"lm", "in"} <= {record[0] for record in records}  # its logged model and dataset inputs wait too
    assert records[-1][:2] == ["end", "FINISHED"]
