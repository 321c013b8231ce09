"""A command run from another folder than the study's: its spec's relative paths (runs/...) do not
resolve, and it says where the study is instead of "has not run yet" (whose advice would start a
second study)."""
from __future__ import annotations

from sweeps import cli
from sweeps.backends import optuna_study
from sweeps.spec.load import load_spec
from tests.sweeps.study_helpers import save_spec, tiny_spec


def test_status_from_another_folder_names_the_folder_the_study_ran_in(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    path = save_spec(project / "studies", tiny_spec("elsewhere"), seed_store=False)
    monkeypatch.chdir(project)
    optuna_study.open_study(load_spec(path))  # the study exists: runs/elsewhere.journal under project/
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    assert cli.main(["status", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"storage: runs/elsewhere.journal is not in this folder ({other}) but in {project}: the spec's paths "
            f"are relative to the folder a command runs in; cd {project} and run the command again") in err
    assert "has not run yet" not in err and not (other / "runs").exists()
