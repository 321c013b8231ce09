"""``sweeps run`` follows a moved MLflow store (repoints its artifact locations) only once it holds
the study's run lock: a run refused because another one holds the study leaves the store that
run is using exactly as it was."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from sweeps import cli
from sweeps.backends.driver import run_lock
from tests.sweeps.study_helpers import write_spec


def _locations(db: Path) -> list[str]:
    with sqlite3.connect(db) as con:
        return sorted(r[0] for r in con.execute("SELECT artifact_location FROM experiments"))


@pytest.mark.slow  # `sweeps run` starts its workers' fork server before it asks for the run lock
def test_a_run_refused_by_the_run_lock_leaves_a_moved_store_unchanged(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path, name="locked_move")
    db = tmp_path / "runs" / "mlflow.db"
    # The store looks moved: its experiment names another project's mlartifacts folder, while the
    # experiment's folder is beside this store.
    old = tmp_path / "elsewhere" / "runs" / "mlartifacts" / "locked_move"
    MlflowClient(f"sqlite:///{db}").create_experiment("locked_move", artifact_location=str(old))
    (tmp_path / "runs" / "mlartifacts" / "locked_move").mkdir(parents=True)
    before = _locations(db)
    assert str(old) in before

    lock = Path(f"{(tmp_path / 'runs' / 'locked_move.journal').resolve()}.runlock")
    with run_lock(lock, "locked_move"):  # another `sweeps run` of the study holds it
        assert cli.main(["run", str(spec), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is already being run by another sweeps process" in err, err
    assert "was moved" not in err, err
    assert _locations(db) == before
