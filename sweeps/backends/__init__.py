"""Study backends: Optuna (default) and Ray Tune, behind one small interface."""
from __future__ import annotations

from sweeps.backends.base import Backend, StudyResult, TrialRecord
from sweeps.errors import UnknownBackendError


def get_backend(name: str, source: object = None) -> Backend:
    """The backend a spec's ``backend:`` names. ``source`` (the spec file) starts the error's
    message when the name is unknown: a spec validated by sweeps.spec never has one, but a spec
    built in code skips that check."""
    if name == "optuna":
        from sweeps.backends.optuna_backend import OptunaBackend

        return OptunaBackend()
    if name == "ray":
        from sweeps.backends.ray_backend import RayBackend

        return RayBackend()
    where = f"{source}: " if source else ""
    raise UnknownBackendError(f"{where}backend: {name!r} is not one of optuna, ray; write "
                              "backend: optuna (the default) or backend: ray in the study spec")


__all__ = ["Backend", "StudyResult", "TrialRecord", "get_backend"]
