"""Leave a finished command at once.

A process that has imported torch, MLflow and Optuna spends a noticeable time in interpreter
finalisation (tearing down modules and collecting their objects) after its work is done: paid
at the end of every ``sweeps`` command and of every worker, in a study's wall time
(benchmarks/README.md, orchestration). Everything that must happen at exit is registered with
:mod:`atexit` (logging's flush, ``weakref.finalize`` callbacks such as temporary folders,
MLflow's end-of-process hooks): those run, then the process exits without the teardown.
Only for entry points: never call it from library code or tests.
"""
from __future__ import annotations

import atexit
import os
import sys


def exit_now(code: int | None) -> None:
    """Flush the standard streams, run the atexit callbacks, and end the process with ``code``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be shown
            pass
    atexit._run_exitfuncs()
    os._exit(int(code or 0))
