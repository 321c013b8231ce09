"""Study backends: Optuna (default) and Ray Tune, behind one small interface."""
from __future__ import annotations

from sweeps.backends.base import Backend, StudyResult, TrialRecord


def get_backend(name: str) -> Backend:
    if name == "optuna":
        from sweeps.backends.optuna_backend import OptunaBackend

        return OptunaBackend()
    if name == "ray":
        from sweeps.backends.ray_backend import RayBackend

        return RayBackend()
    raise ValueError(f"backend: {name!r} is not one of optuna, ray")


__all__ = ["Backend", "StudyResult", "TrialRecord", "get_backend"]
