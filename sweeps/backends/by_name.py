"""The backend a spec's ``backend:`` names.

Each backend is imported only when it is asked for: Ray takes seconds to import, and a command
on an Optuna study (or ``sweeps report``) does not load it. Nothing under sweeps.backends imports
this module, so the backends never import each other through it."""
from __future__ import annotations

from sweeps.backends.base import Backend
from sweeps.errors import UnknownBackendError


def get_backend(name: str, source: object = None) -> Backend:
    """The backend a spec's ``backend:`` names. ``source`` (the spec file) starts the error's
    message when the name is unknown: a spec validated by sweeps.spec never has one, but a spec
    built in code skips that check."""
    if name == "optuna":
        from sweeps.backends.optuna_backend import OptunaBackend  # lazy for start-up, see above

        return OptunaBackend()
    if name == "ray":
        from sweeps.backends.ray_backend import RayBackend  # lazy for start-up: importing Ray takes seconds

        return RayBackend()
    where = f"{source}: " if source else ""
    raise UnknownBackendError(f"{where}backend: {name!r} is not one of optuna, ray; write "
                              "backend: optuna (the default) or backend: ray in the study spec")
