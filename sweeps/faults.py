"""Fault-injection points for tests (``SWEEPS_FAULT=point[,point]``): one implementation,
in :mod:`core.faults`, since ``core`` may not import ``sweeps``."""
from core.faults import ENV_FAULT, armed, stop_here

__all__ = ["ENV_FAULT", "armed", "stop_here"]
