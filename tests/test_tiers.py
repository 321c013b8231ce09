"""The fast tier (`make test-fast`): the markers it leaves out, and the guard in tests/conftest.py
that fails a test of the fast tier which starts a study (`sweeps run`, or Optuna worker processes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sweeps.backends.worker_forkserver import AUDIT_START

ROOT = Path(__file__).resolve().parents[1]


def _conftest(request):
    """tests/conftest.py as pytest loaded it (the guard's state lives there)."""
    path = str(ROOT / "tests" / "conftest.py")
    [module] = [p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path]
    return module


def test_make_test_fast_leaves_out_the_markers_the_guard_knows_and_they_are_registered(request):
    not_fast = _conftest(request).NOT_FAST
    assert set(not_fast) == {"slow", "ray", "browser", "postgres", "slurm"}
    makefile = (ROOT / "Makefile").read_text()
    assert "FAST_TIER := " + " and ".join(f"not {m}" for m in not_fast) + "\n" in makefile
    assert '-m "$(FAST_TIER)"' in makefile
    registered = [line.split(":")[0] for line in request.config.getini("markers")]
    assert set(not_fast) <= set(registered)


def test_a_fast_test_that_starts_a_study_is_caught(request):
    conftest = _conftest(request)
    # Harmless processes (python -c pass) whose command lines read as what a test would start.
    looks_like = {
        "a study": [sys.executable, "-c", "pass", "-m", "sweeps.cli", "run", "x.yaml", "--quiet"],
        "a worker": [sys.executable, "-c", "pass", "-m", "sweeps.backends.optuna_worker"],
        "help": [sys.executable, "-c", "pass", "-m", "sweeps.cli", "run", "--help"],
        "validate": [sys.executable, "-c", "pass", "-m", "sweeps.cli", "validate", "x.yaml"],
    }
    for argv in looks_like.values():
        subprocess.run(argv, check=True, timeout=120)
    sys.audit(AUDIT_START, 0)  # as worker_forkserver.start raises it (sweeps run in this process)
    caught = list(conftest._current["starts"])
    conftest._current["starts"].clear()  # this test itself passes
    assert len(caught) == 3, caught
    assert "sweeps.cli run x.yaml" in caught[0] and "sweeps.backends.optuna_worker" in caught[1]
    assert "fork server" in caught[2]
