"""The one module of sweeps that touches Ray's private API (``ray.train._internal``).

Ray may move or drop a private name in any release. Keeping every such use here makes an upgrade
a review of one short file: re-check each function below against the new Ray's source, then
update :data:`RAY_CHECKED` (tests/test_private_apis.py fails until then, and fails if any other
module of core/, sweeps/ or dashboards/ imports a private Ray module). Each function says why
Ray's public API does not do it.
"""
from __future__ import annotations

from typing import Any

RAY_CHECKED = "2.60.0"  # the Ray version every function below was read against


def training_result(checkpoint: Any, metrics: dict[str, Any]) -> Any:
    """What a function trainable's actor restores from: a checkpoint and its metrics.

    ``Trainable.restore`` is handed a ``_TrainingResult``; substituting another checkpoint (the
    newest one still on disk) means building one, and Ray exports no constructor for it."""
    from ray.train._internal.session import _TrainingResult  # lazy: only an actor restoring a trial needs Ray

    return _TrainingResult(checkpoint=checkpoint, metrics=metrics)


def running_trial_thread() -> Any | None:
    """This actor's Ray Train session while its trial's training thread is alive, else None.

    A function trainable runs the trial in a thread of the actor; ``reset_config`` and ``cleanup``
    must let that thread stop with a checkpoint before the actor is reused or torn down, and only
    the session (``get_session``, not in ``ray.train``'s public API) holds the thread."""
    from ray.train._internal.session import get_session  # lazy: only an actor stopping a trial needs Ray

    session = get_session()
    if session is not None and session.training_started and session.training_thread.is_alive():
        return session
    return None
