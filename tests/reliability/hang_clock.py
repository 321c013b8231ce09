"""The supervisor's clock for the trial_timeout tests: it reads ``seconds`` ahead while the hang
task hangs (tests/reliability/fault_tasks.py writes its marker, then sleeps for good) and its trial
has not failed yet, and the true time otherwise. budget.trial_timeout then passes with the trial
hung, at once and on any machine, and every other trial runs on the true clock."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from sweeps.backends import supervisor
from tests.sweeps.study_helpers import load_study


def clock_ahead_while_hung(monkeypatch, folder: Path, study: str, marker: Path, seconds: float) -> None:
    def hung() -> bool:
        if not marker.exists():
            return False
        try:
            return not any(t.state.name == "FAIL" for t in load_study(folder, study).trials)
        except Exception:  # noqa: BLE001 - the journal may be mid-write while the study runs: the true time
            return False

    monkeypatch.setattr(supervisor, "time", SimpleNamespace(
        monotonic=time.monotonic, time=lambda: time.time() + (seconds if hung() else 0)))
