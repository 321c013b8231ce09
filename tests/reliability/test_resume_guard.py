"""The resume guard of an Optuna study: a refused resume writes nothing to the study's storage,
and task settings written at the task's own defaults read as unset (as train settings do)."""
from __future__ import annotations

import pytest

from sweeps.backends.optuna_study import open_study
from sweeps.errors import StudyStateError
from sweeps.spec.load import load_spec
from tests.sweeps.study_helpers import write_spec

TASK = {"name": "digits", "model": None, "args": {"width": 32}}


def _spec(tmp_path, **overrides):
    return load_spec(write_spec(tmp_path, name="guard", seed_store=False, **{"task": TASK, **overrides}))


@pytest.mark.parametrize("change", [
    {"search": {"lr": {"type": "float", "low": 0.001, "high": 0.5, "log": True}}},
    {"train": {"epochs": 5}},
    {"objective": {"metric": "val_loss", "direction": "minimize"}},
    {"task": {**TASK, "args": {"width": 48}}},
], ids=["search", "train", "objective", "task"])
def test_a_refused_resume_writes_nothing_to_the_journal(tmp_path, monkeypatch, change):
    monkeypatch.chdir(tmp_path)
    open_study(_spec(tmp_path))
    journal = tmp_path / "runs" / "guard.journal"
    before = journal.read_bytes()
    for _ in range(2):
        with pytest.raises(StudyStateError):
            open_study(_spec(tmp_path, **change))
    assert journal.read_bytes() == before


def test_task_settings_written_at_their_defaults_are_accepted_on_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = open_study(_spec(tmp_path))
    spelled = {**TASK, "model": "cnn", "args": {"width": 32, "val_fraction": 0.2}}  # digits' own defaults
    again = open_study(_spec(tmp_path, task=spelled))
    assert again.user_attrs == first.user_attrs
    with pytest.raises(StudyStateError, match=r"task\.args: \{'width': 32\} -> \{'width': 32, 'val_fraction': 0\.3\}"):
        open_study(_spec(tmp_path, task={**spelled, "args": {"width": 32, "val_fraction": 0.3}}))
