"""Durations in a study spec: ``budget.timeout`` and ``budget.trial_timeout``.

A duration is a positive number of seconds (``90``, ``1.5``) or a string of
units in the order d, h, m, s, each at most once: ``"90s"``, ``"30m"``, ``"2h"``,
``"1h30m"``, ``"1d12h"``, ``"1.5h"``. ``"1:30"`` is refused on purpose: it reads as
90 seconds to some people and 90 minutes to others.
"""
from __future__ import annotations

import math
import os
import re

_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION_RE = re.compile(
    r"^(?:(?P<d>\d+(?:\.\d+)?)d)?(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$"
)
EXAMPLES = "a number of seconds or a string such as 90s, 30m, 2h, 1h30m"


def parse_duration(value: object) -> float | None:
    """Seconds in ``value`` (None stays None). Raises ValueError naming the value and the fix."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration; use {EXAMPLES}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().replace(" ", "").lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", text):  # "90": seconds, like the bare number 90
            text += "s"
        match = _DURATION_RE.match(text) if text else None
        if match is None or not any(match.groupdict().values()):
            raise ValueError(f"{value!r} is not a duration; use {EXAMPLES}")
        seconds = sum(float(v) * _UNIT_SECONDS[k] for k, v in match.groupdict().items() if v)
    else:
        raise ValueError(f"{value!r} is not a duration; use {EXAMPLES}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{value!r} is not a positive duration; use {EXAMPLES}, or null for no limit")
    return seconds


def env_seconds(name: str, default: float) -> float:
    """A number of seconds >= 0 from the environment variable ``name`` (tests and operators tune
    waits this way); ``default`` when unset or not a number."""
    text = os.environ.get(name, "").strip()
    try:
        return max(0.0, float(text)) if text else default
    except ValueError:
        return default


# How long a stopped trial may take to checkpoint and close its run before it is killed: an Optuna
# worker process (sweeps.backends.supervisor) or a Ray actor (sweeps.backends.ray_trainable).
STOP_GRACE_S = 60.0
ENV_STOP_GRACE = "SWEEPS_STOP_GRACE_S"


def stop_grace_seconds() -> float:
    return env_seconds(ENV_STOP_GRACE, STOP_GRACE_S)


# How long a process waits for a store it has used and that stopped answering, while trials train
# on, before it stops as on SIGTERM: the Optuna storage (sweeps.backends.optuna_outage) and the MLflow
# tracking store (sweeps.tracking.outage). One limit for both: an operator bounds "the infrastructure
# is away" once, and the two stores are often one database server, away for the same time.
STORAGE_WAIT_S = 300.0
ENV_STORAGE_WAIT = "SWEEPS_STORAGE_WAIT_S"


def store_wait_seconds() -> float:
    return env_seconds(ENV_STORAGE_WAIT, STORAGE_WAIT_S)
