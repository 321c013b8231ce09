"""Fixtures for the tracking tests: a counting wrapper around the real client, and a real
``mlflow server`` that a test can stop and start again (the shared store and ``make_tracker``
are tests/sweeps/conftest.py's). No mocks of MlflowClient."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAST_HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}


def pick_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingClient:
    """The real MlflowClient, counting the calls that write (to prove batching)."""

    def __init__(self, client) -> None:
        self._client = client
        self.calls: dict[str, int] = {}
        self.metrics_accepted = 0  # metric points in log_batch calls that succeeded

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name in ("log_batch", "log_artifact", "set_terminated", "log_metric", "log_param", "set_tag"):
            def counted(*args, **kwargs):
                self.calls[name] = self.calls.get(name, 0) + 1
                out = attr(*args, **kwargs)
                if name == "log_batch":
                    self.metrics_accepted += len(kwargs.get("metrics", ()))
                return out

            return counted
        return attr


class MlflowServer:
    """``mlflow server`` on a free localhost port in its own process group, so ``stop``
    can kill it (and its uvicorn workers) at once, like a crash, and ``start`` bring it
    back on the same port and database."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = pick_free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.backend_uri = f"sqlite:///{root / 'server.db'}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        import requests

        exe = Path(sys.executable).parent / "mlflow"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
        cmd += [
            "server", "--backend-store-uri", self.backend_uri,
            "--artifacts-destination", str(self.root / "server-artifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        # The job runner is a pool of extra processes these tests never use.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                if requests.get(f"{self.uri}/health", timeout=1).status_code == 200:
                    return
            except requests.exceptions.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server did not start in {timeout_s} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None
        # Wait until the port refuses connections: "down" must really be down.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.05)


@pytest.fixture
def fast_http_env(monkeypatch) -> None:
    """What MlflowTracker sets for http URIs, set through monkeypatch so it is undone."""
    for name, value in FAST_HTTP_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(params=["mlflow"])
def any_tracker(request, make_tracker):
    """The Tracker contract's subjects (``test_tracker_contract.py``): ``any_tracker()`` is a
    fresh MlflowTracker, the one implementation the product writes through."""
    return make_tracker


@pytest.fixture
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()
