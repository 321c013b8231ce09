"""Shared fixtures. Tests run on CPU with one thread per process unless they say otherwise.

The fast tier (``make test-fast``) leaves out the tests marked ``slow``, ``ray``, ``browser``,
``postgres`` or ``slurm`` (:data:`NOT_FAST`). A test in the fast tier that starts a study (``sweeps run``
in a subprocess, or in this process, which starts its worker processes) fails with a message
asking for the ``slow`` marker: see :func:`_watch_study_processes`."""
from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from sweeps.backends import worker_forkserver
from sweeps.backends.worker_forkserver import AUDIT_START

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def one_fork_server_per_test_process():
    """The studies a test process runs in-process fork their workers from one fork server, which
    imports torch, MLflow and the trainer once (seconds of CPU) instead of once per study."""
    with worker_forkserver.kept_between_studies():
        yield


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


NOT_FAST = ("slow", "ray", "browser", "postgres", "slurm")  # the markers `make test-fast` deselects
# What MLflow (its default artifact root, ./mlruns) and sweeps (runs/) create in the working folder:
# a test that lets one through writes into the checkout, where later runs and `git status` find it.
CHECKOUT_STRAYS = ("mlruns", "runs")
# What a study start looks like on a command line: the CLI's `run`, or a local Optuna worker.
_STUDY_MODULES = ("sweeps.backends.optuna_worker",)
_current: dict[str, Any] = {"item": None, "starts": [], "strays": set()}


def _starts_a_study(argv: list[str]) -> bool:
    if "--help" in argv or "-h" in argv:
        return False
    if any(module in argv for module in _STUDY_MODULES):
        return True
    for i, word in enumerate(argv[:-1]):
        if (word == "sweeps.cli" or Path(word).name == "sweeps") and argv[i + 1] == "run":
            return True
    return False


def _watch_study_processes(event: str, args: tuple) -> None:
    """An audit hook (it sees every subprocess this test process starts): records a study
    started by a test outside the slow tiers, for :func:`pytest_runtest_makereport`."""
    if _current["item"] is None:
        return
    if event == AUDIT_START:  # the fork server of `sweeps run`'s workers, started in this process
        _current["starts"].append("the fork server of sweeps run's workers")
        return
    if event != "subprocess.Popen":
        return
    try:
        argv = [os.fsdecode(a) for a in args[1]] if not isinstance(args[1], (str, bytes)) else [os.fsdecode(args[1])]
    except TypeError:
        return
    if _starts_a_study(argv):
        _current["starts"].append(" ".join(argv)[:300])


def _strays() -> set[str]:
    return {name for name in CHECKOUT_STRAYS if (ROOT / name).exists()}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    fast = not any(item.get_closest_marker(name) for name in NOT_FAST)
    _current["item"], _current["starts"], _current["strays"] = (item if fast else None), [], _strays()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown":
        _current["item"] = None
    if call.when == "call" and _current["item"] is item and _current["starts"] and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started a study ({_current['starts'][0]}) but is in the fast tier "
            f"(`make test-fast`): mark it (or its module) @pytest.mark.slow")
    new = _strays() - _current["strays"] if call.when == "call" else set()
    if new and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{', '.join(sorted(new))} appeared in the checkout ({ROOT}) while {item.nodeid} ran (it, or the "
            "test beside it in the other test process, wrote there): give trackers a spool and an artifact "
            "root under tmp_path, or run the test in a tmp folder (the in_tmp fixture)")


def pytest_configure(config):
    sys.addaudithook(_watch_study_processes)
    # Two cores on CI: keep torch from spawning more threads than there are cores, counting the
    # processes that run tests at once (two processes with two threads each would make torch's
    # threads wait for each other's cores). The xdist controller runs no test: its workers decide.
    if not _is_xdist_controller(config):
        from sweeps.slot_plan import cpu_threads_available  # the pool's count: affinity mask, cgroup cpusets

        threads = cpu_threads_available() // _xdist_workers()
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, threads))))
    # The digits split cache (core/tasks/digits.py) of this session, shared by its subprocesses:
    # written by the first test that loads digits, never in the user's home folder.
    if "SWEEPS_CACHE_DIR" not in os.environ:
        config._sweeps_cache = os.environ["SWEEPS_CACHE_DIR"] = tempfile.mkdtemp(prefix="sweeps-cache-")


def pytest_unconfigure(config):
    if getattr(config, "_sweeps_cache", None):
        shutil.rmtree(config._sweeps_cache, ignore_errors=True)
