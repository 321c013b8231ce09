"""Shared fixtures. Tests run on CPU with one thread per process unless they say otherwise."""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run the test with the current directory set to a fresh tmp folder (runs/ lands there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _xdist_workers() -> int:
    """How many pytest-xdist processes run tests (``make test`` runs 2); 1 without xdist."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _is_xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and "PYTEST_XDIST_WORKER" not in os.environ


def pytest_configure(config):
    # Two cores on CI: keep torch from spawning more threads than there are cores, counting the
    # processes that run tests at once (two processes with two threads each would make torch's
    # threads wait for each other's cores). The xdist controller runs no test: its workers decide.
    if not _is_xdist_controller(config):
        from sweeps.pool import cpu_threads_available  # the pool's count: affinity mask, cgroup cpusets

        threads = cpu_threads_available() // _xdist_workers()
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, threads))))
    # The digits split cache (core/tasks/digits.py) of this session, shared by its subprocesses:
    # written by the first test that loads digits, never in the user's home folder.
    if "SWEEPS_CACHE_DIR" not in os.environ:
        config._sweeps_cache = os.environ["SWEEPS_CACHE_DIR"] = tempfile.mkdtemp(prefix="sweeps-cache-")


def pytest_unconfigure(config):
    if getattr(config, "_sweeps_cache", None):
        shutil.rmtree(config._sweeps_cache, ignore_errors=True)
