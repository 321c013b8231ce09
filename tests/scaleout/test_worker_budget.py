"""A worker out of budget on PostgreSQL stays while another machine's trial runs, so that the
trial's retry is run if that machine dies: a retry requeued while the worker looks at the study
is asked on its next round, never left WAITING by workers that all left."""
from __future__ import annotations

import optuna
import pytest

from sweeps.backends import optuna_adapter, optuna_study
from sweeps.backends import optuna_recovery as recovery
from sweeps.backends.optuna_worker import next_trials
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import migrated_store, tiny_spec

pytestmark = pytest.mark.postgres


class _RequeuedAfterTheFirstRead:
    """The study, as a worker reads it while another machine's stale-trial check fails ``dead``
    and requeues it: right after the worker's first read of its trials."""

    def __init__(self, study: optuna.Study, dead: optuna.Trial, tracking_uri: str) -> None:
        self._study, self._dead, self._tracking_uri, self._read = study, dead, tracking_uri, False

    def __getattr__(self, name: str):
        return getattr(self._study, name)

    def get_trials(self, *args, **kwargs):
        trials = self._study.get_trials(*args, **kwargs)
        if not self._read:
            self._read = True
            recovery.fail_trial(self._study, optuna_adapter.stored_trial(self._study, self._dead), "heartbeat lost",
                                requeue=True, tracking_uri=self._tracking_uri, interrupted=True)
        return trials


def test_a_worker_out_of_budget_stays_for_a_trial_requeued_while_it_looks(tmp_path, fresh_db):
    spec = spec_from_dict(tiny_spec("stays", storage=fresh_db(), tracking={"uri": migrated_store(tmp_path)},
                                    budget={"n_trials": 1}))
    study = optuna_study.open_study(spec)
    other = study.ask()  # another machine's trial, the whole budget, alive until it is failed below
    optuna_adapter.record_heartbeat(study, optuna_adapter.trial_id_of(other))
    looking = _RequeuedAfterTheFirstRead(study, other, spec.tracking_store_uri())
    assert next_trials(spec, looking, 1, 1) == ([], True)  # the budget is taken and a trial runs: it stays
    assert looking._read  # the trial was failed and requeued while the worker looked
    [retry], _ = next_trials(spec, study, 1, 1)  # its next round
    assert optuna_adapter.stored_trial(study, retry).system_attrs["failed_trial"] == other.number
