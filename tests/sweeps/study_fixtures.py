"""One small finished digits study (real training, real MLflow sqlite store), shared by the
promote, rerun and compare tests.

Import the fixtures into a test module (``from tests.sweeps.study_fixtures import ...``).
Each importing module gets its own copy of the session fixture, so the study itself is
cached here: it is trained once per test session whichever modules use it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import save_spec, tiny_spec, with_overrides

STUDY = "digits_sweep"
WEAK = "digits_weak"

# The tiny study, trained longer (3 epochs, momentum) and exported to ONNX, in 3 trials.
BASE_CHANGES = {
    "description": "promote/rerun/compare tests",
    "train": {"epochs": 3, "batch_size": 64, "momentum": 0.9, "export_onnx": True},
    "search": {"lr": {"type": "float", "low": 0.003, "high": 0.3, "log": True}},
    "budget": {"n_trials": 3, "max_failures": 1},
}


@dataclass
class Study:
    root: Path  # the working directory the study ran in (runs/ is under it)
    name: str
    spec: Path

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.root / 'runs' / 'mlflow.db'}"

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def trial_runs(self) -> dict[int, object]:
        """trial number -> MLflow run of each trial."""
        client = self.client()
        exp = client.get_experiment_by_name(self.name)
        runs = client.search_runs([exp.experiment_id], "tags.`sweeps.role` = 'trial'", max_results=100)
        return {int(r.data.tags["sweeps.trial_number"]): r for r in runs}

    def checkpoint(self, number: int) -> Path:
        return self.root / "runs" / self.name / f"trial-{number:04d}" / "best.pt"


_CACHE: dict[str, Study] = {}


def _run_study(root: Path, name: str, **changes) -> Study:
    from sweeps import cli

    spec = with_overrides(tiny_spec(name, **BASE_CHANGES), **changes)
    path = save_spec(root, spec)
    before = os.getcwd()
    os.chdir(root)  # the spec's runs/ paths are relative to the working directory
    try:
        code = cli.main(["run", str(path), "--quiet"])
    finally:
        os.chdir(before)
    assert code == 0, f"study {name} did not finish (exit {code})"
    return Study(root, name, path)


def _root(tmp_path_factory) -> Path:
    if "root" not in _CACHE:
        _CACHE["root"] = tmp_path_factory.mktemp("finished-study")  # type: ignore[assignment]
    return _CACHE["root"]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def finished_study(tmp_path_factory) -> Study:
    """3 trials x 3 epochs of a digits MLP (random sampler, no pruner, ONNX exported)."""
    if STUDY not in _CACHE:
        _CACHE[STUDY] = _run_study(_root(tmp_path_factory), STUDY)
    return _CACHE[STUDY]


@pytest.fixture(scope="session")
def weak_study(tmp_path_factory, finished_study) -> Study:
    """One trial of one epoch at a tiny learning rate, in the same store: clearly worse, no ONNX."""
    if WEAK not in _CACHE:
        _CACHE[WEAK] = _run_study(_root(tmp_path_factory), WEAK, train={"epochs": 1, "export_onnx": False},
                                  search={"lr": {"type": "float", "low": 1.0e-4, "high": 1.1e-4, "log": True}},
                                  budget={"n_trials": 1})
    return _CACHE[WEAK]


@pytest.fixture
def in_study(finished_study, monkeypatch) -> Study:
    """The test runs in the study's folder (commands find runs/mlflow.db there)."""
    from sweeps.commands import console

    monkeypatch.chdir(finished_study.root)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(console, "width", 200)  # long run ids on one line
    return finished_study
