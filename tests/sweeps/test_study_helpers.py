"""The helpers that run the `sweeps` CLI for tests: a command run in this process sees the
environment a subprocess of run_cli would, and leaves this process's as it found it."""
from __future__ import annotations

import os

from tests.sweeps.study_helpers import cli_in_process


def test_a_command_run_in_process_sees_the_callers_environment_and_its_own(tmp_path, monkeypatch):
    from sweeps import cli

    seen: dict[str, str] = {}

    def main(args: list[str]) -> int:
        seen.update(os.environ, cwd=os.getcwd())
        print("ran", *args)
        return 3

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setenv("SWEEPS_PROBE", "kept")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://the-callers-store")
    proc = cli_in_process(tmp_path, "status", "x.yaml", EXTRA="1")
    assert (proc.returncode, proc.stdout) == (3, "ran status x.yaml\n")
    # What the caller had (the thread count, the data cache, PATH), the run's own, never the caller's store.
    assert seen["SWEEPS_PROBE"] == "kept" and seen["EXTRA"] == "1" and seen["PATH"] == os.environ["PATH"]
    assert "MLFLOW_TRACKING_URI" not in seen and seen["cwd"] == str(tmp_path)
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://the-callers-store" and "EXTRA" not in os.environ
    assert os.getcwd() != str(tmp_path)
