"""The one module of sweeps that touches MLflow's private API (names starting with ``_``).

MLflow may move or drop a private name in any release, without a deprecation warning. Keeping
every such use here makes an upgrade a review of one short file: re-check each function below
against the new MLflow's source, then update :data:`MLFLOW_CHECKED` (tests/test_private_apis.py
fails until then, and fails if any other module of core/, sweeps/ or dashboards/ reaches into a
private name of MLflow, Ray or Optuna). Each function says why MLflow's public API does not do it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

MLFLOW_CHECKED = "3.17.2"  # the MLflow version every function below was read against


@contextlib.contextmanager
def fluent_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` for a moment: ``log_model`` and the SQL registry
    store (which looks the logged model up to create a version) read it, not the client's.

    The public ``mlflow.set_tracking_uri`` could not put the process back as it was: an unset
    URI reads back from ``get_tracking_uri`` as the resolved default, and setting that would pin
    it for the rest of the process. MLflow's ``_use_tracking_uri`` restores the unset state."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri  # lazy: mlflow, only to promote

    with _use_tracking_uri(uri):
        yield
