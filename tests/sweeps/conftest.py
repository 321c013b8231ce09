"""Fixtures for the tests of sweeps: a real MLflow store (sqlite + file artifacts) shared by the
session, and MlflowTrackers on it whose spool and artifacts stay under the test's folders (never
./mlruns of the working folder, MLflow's default artifact root)."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import migrated_store


class Store:
    """One sqlite tracking store with a file artifact root, shared by the session
    (creating the schema takes seconds); each test uses its own experiment."""

    def __init__(self, root: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.root = root
        self.uri = migrated_store(root)  # the schema already made: a fresh store per test costs no migration
        self.artifact_root = root / "artifacts"
        self.client = MlflowClient(tracking_uri=self.uri)

    def experiment_name(self) -> str:
        return f"exp-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("mlflow-store"))


@pytest.fixture
def make_tracker(store, tmp_path):
    """Build an MlflowTracker on the shared store with its spool under tmp_path."""
    from sweeps.tracking.mlflow_tracker import MlflowTracker

    def make(uri: str | None = None, client=None, **kwargs) -> MlflowTracker:
        kwargs.setdefault("spool_dir", tmp_path / "spool")
        kwargs.setdefault("artifact_root", store.artifact_root)
        return MlflowTracker(uri or store.uri, client=client, **kwargs)

    return make
