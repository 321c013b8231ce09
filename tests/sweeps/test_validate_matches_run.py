"""`sweeps validate` refuses what `sweeps run` would refuse, and `run` refuses it before it
creates anything: every name and path check of the run is part of loading the spec. A spec
nested too deeply to read is a spec error too, never a traceback. Through the CLI's main, in
this process: every case is refused before anything starts."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.sweeps.study_helpers import cli_in_process, tiny_spec


def _save(folder: Path, spec: dict) -> Path:
    path = folder / "study.yaml"  # not <name>.yaml: the names here are not file names
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _validate_and_run_refuse(folder: Path, spec: Path, *expected: str) -> None:
    for args in (("validate", str(spec)), ("run", str(spec), "--quiet")):
        proc = cli_in_process(folder, *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and str(spec) in proc.stderr
        for text in expected:
            assert text in proc.stderr, proc.stderr
    assert not (folder / "runs").exists()
    assert sorted(p.name for p in folder.iterdir()) == [spec.name]


@pytest.mark.parametrize("name", ["tiny\n", "tiny\n\n", "a\tb"])
def test_a_study_name_with_control_characters_is_refused(tmp_path, name):
    spec = _save(tmp_path, tiny_spec(name))
    _validate_and_run_refuse(tmp_path, spec, f"- name: {name!r} is not allowed")


@pytest.mark.parametrize("experiment", ["../../etc", "team/exp", "..", "%2e%2e", "a\\b", "x\n"])
def test_an_experiment_name_that_would_leave_its_folder_is_refused(tmp_path, experiment):
    spec = _save(tmp_path, tiny_spec(tracking={"uri": "sqlite:///runs/mlflow.db", "experiment": experiment}))
    _validate_and_run_refuse(tmp_path, spec, f"- tracking.experiment: experiment name {experiment!r} is refused")


def test_a_plain_experiment_name_is_kept(tmp_path):
    spec = _save(tmp_path, tiny_spec(tracking={"uri": "sqlite:///runs/mlflow.db", "experiment": "team.exp-1"}))
    proc = cli_in_process(tmp_path, "validate", str(spec))
    assert proc.returncode == 0, proc.stderr


def test_worker_plans_the_run_would_refuse_are_spec_errors(tmp_path):
    spec = _save(tmp_path, tiny_spec(resources={"devices": [0], "workers": 3}))
    _validate_and_run_refuse(tmp_path, spec, "- resources.workers: 3 workers do not fit on devices [0]")
    spec = _save(tmp_path, tiny_spec(storage="sqlite:///runs/optuna.db", resources={"devices": "cpu", "workers": 2}))
    _validate_and_run_refuse(tmp_path, spec, "- storage: 'sqlite:///runs/optuna.db' is SQLite")


def _deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("body", [
    f"train: {{x: {_deep_list(500)}}}\n",  # about 1 KB: PyYAML alone would end in a RecursionError
    f"x: {_deep_list(500)}\n",
    "- " * 400 + "a\n",  # block style nests just as deep
    # Aliases nesting a small anchor deeper at each step: a short file, a deep document.
    "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 60)),
])
def test_deeply_nested_yaml_is_a_spec_error(tmp_path, body):
    spec = tmp_path / "study.yaml"
    spec.write_text("name: deep\ntask: {name: digits}\n" + body if not body.startswith("- ") else body)
    _validate_and_run_refuse(tmp_path, spec, "nesting deeper than 32 levels")
