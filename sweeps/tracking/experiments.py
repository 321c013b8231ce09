"""The study's MLflow experiment: found by name, created when missing."""
from __future__ import annotations

from typing import Any

from sweeps.errors import TrackingError
from sweeps.safe_names import safe_component


def experiment_id_of(client: Any, name: str, artifact_root: str | None, tracking_uri: str) -> str:
    """The id of experiment ``name``, created if missing (a parallel worker may win), its
    artifacts under ``<artifact_root>/<name>`` when a root is given. TrackingError for a
    deleted experiment; the store's own errors propagate."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        location = f"{artifact_root}/{safe_component(name, 'experiment name')}" if artifact_root is not None else None
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:
            # RESOURCE_ALREADY_EXISTS: a parallel worker created it first; use theirs.
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        exp = client.get_experiment_by_name(name)
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"MLflow experiment {name!r} (id {exp.experiment_id}) at {tracking_uri} is deleted. Restore it "
            f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or name the study's experiment "
            "differently."
        )
    return exp.experiment_id
