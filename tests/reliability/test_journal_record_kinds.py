"""A journal record of a kind this Optuna does not know (``{"op_code": 99, ...}``: a newer
Optuna's, or one written by hand): every command refuses the journal with the file, the line
and the repair command (exit 2), and ``sweeps repair-journal`` repairs it; Optuna's own reader
stops on it with a bare ``AssertionError: Should not reach.``."""
from __future__ import annotations

import json

import optuna
import pytest

from sweeps.backends.journal_file import open_journal, repair_journal
from sweeps.errors import StudyStateError
from tests.sweeps.study_helpers import cli_in_process, write_spec

UNKNOWN = {"op_code": 99, "worker_id": "w", "study_id": 0}


def _journal_with_an_unknown_record(path, trials: int = 2) -> int:
    """A journal of one study with ``trials`` finished trials, then a record of kind 99; returns
    the number of good records before it."""
    study = optuna.create_study(study_name="kinds", storage=open_journal(path, create=True))
    for i in range(trials):
        study.tell(study.ask(), float(i))
    good = len(path.read_bytes().splitlines())
    with open(path, "a") as fh:
        fh.write(json.dumps(UNKNOWN) + "\n")
    return good


def test_a_record_of_an_unknown_kind_is_refused_naming_file_line_and_fix(tmp_path):
    journal = tmp_path / "kinds.journal"
    good = _journal_with_an_unknown_record(journal)
    before = journal.read_bytes()
    for create in (False, True):  # a reader (status) and a writer (run) alike
        with pytest.raises(StudyStateError) as refused:
            open_journal(journal, create=create)
        text = str(refused.value)
        assert text.startswith(f"{journal}: line {good + 1}: record {good + 1} has an unknown kind (op_code 99"), text
        assert text.endswith(f"run: sweeps repair-journal {journal}"), text
        assert refused.value.exit_code == 2
        assert journal.read_bytes() == before  # nothing cut or appended


def test_repair_journal_drops_the_unknown_record_and_keeps_the_study(tmp_path):
    journal = tmp_path / "kinds.journal"
    good = _journal_with_an_unknown_record(journal)
    said = repair_journal(journal)
    assert "record of an unknown kind at line" in said and f"kept {good} intact records" in said, said
    assert len(journal.read_bytes().splitlines()) == good
    study = optuna.load_study(study_name="kinds", storage=open_journal(journal, create=False))
    assert [t.value for t in study.trials] == [0.0, 1.0]
    assert "all" in repair_journal(journal) and "intact" in repair_journal(journal)


def test_status_on_a_journal_with_an_unknown_record_exits_2_with_one_line(tmp_path):
    spec = write_spec(tmp_path, name="kinds", seed_store=False)
    journal = tmp_path / "runs" / "kinds.journal"
    journal.parent.mkdir()
    good = _journal_with_an_unknown_record(journal)
    proc = cli_in_process(tmp_path, "status", str(spec))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Should not reach" not in proc.stderr, proc.stderr
    assert f"line {good + 1}: record {good + 1} has an unknown kind (op_code 99" in proc.stderr, proc.stderr
    assert f"sweeps repair-journal {journal}" in proc.stderr, proc.stderr
