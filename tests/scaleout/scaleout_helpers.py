"""Helpers of the scale-out tests: processes, the MLflow REST API, the study in PostgreSQL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """scripts.browser.wait_http, failing the test (AssertionError) when the server does not answer."""
    from scripts.browser import BrowserError
    from scripts.browser import wait_http as poll

    try:
        poll(url, proc, log, limit_s=timeout)
    except BrowserError as exc:
        raise AssertionError(str(exc)) from None


def stop_group(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM the process group this test started (the process is its leader), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children left in the group
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


# MLflow's SQL store holds up to 5 + 10 connections per server by default; tests on two xdist
# workers start several servers beside multi-process studies on the one PostgreSQL (100 connections).
_SMALL_POOL = {"MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": "2", "MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW": "3"}
# MLflow's job runner is one more process importing MLflow at every server start (about half of a
# start's CPU), for server-side jobs that sweeps never submits.
_NO_JOB_RUNNER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow_server(folder: Path, store: str, port: int, *args: str, env: dict | None = None,
                        timeout: float = 300):
    """Start ``mlflow server`` on ``store`` and 127.0.0.1:``port``, artifacts proxied into
    ``folder/mlartifacts``, extra CLI ``args`` and ``env``; wait for /health. Returns (process, base
    URL, artifacts folder, log file); stop it with ``stop_group``. The health wait is generous: the
    first start migrates the store (and the auth store), which a slow machine takes minutes for."""
    artifacts = folder / "mlartifacts"
    log = folder / f"mlflow_server_{port}.log"
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow), "server", "--backend-store-uri", store, "--serve-artifacts",
           "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", *args]
    base_env = {k: v for k, v in os.environ.items()
                if k != "MLFLOW_TRACKING_URI" and not k.startswith(("MLFLOW_TRACKING_", "MLFLOW_AUTH_"))}
    with open(log, "w") as out:
        # Its own session: teardown stops the server and the uvicorn children it starts.
        proc = subprocess.Popen(cmd, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**base_env, **_SMALL_POOL, **_NO_JOB_RUNNER, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", timeout=timeout, proc=proc, log=log)
    except BaseException:
        stop_group(proc)
        raise
    return proc, base, artifacts, log


def rest(base: str, path: str, body: dict | None = None) -> dict:
    """GET (no body) or POST JSON to the MLflow REST API."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def wait_for(predicate, timeout: float = 180, every: float = 0.1, what="condition"):
    """Poll ``predicate`` until it returns something truthy; ``what`` (text, or a callable giving
    it, e.g. the processes' output so far) goes into the error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what() if callable(what) else what} not reached within {timeout} s")


class Output:
    """Collects a process's merged stdout/stderr in a thread (so its pipe never fills up)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the process to exit; (exit code, all its output)."""
        self.proc.wait(timeout=timeout)
        self._thread.join(timeout=10)
        return self.proc.returncode, self.text()


def kill_all(outputs: list[Output]) -> None:
    """A test's end: every process still there is killed (continued first, if a test stopped it)."""
    for out in outputs:
        if out.proc.poll() is None:
            os.kill(out.proc.pid, signal.SIGCONT)
            out.proc.kill()
            out.proc.wait(timeout=30)


def pg_study(url: str, name: str):
    """The study as Optuna stores it (a plain read-only view: no heartbeat, no callbacks). A
    connection only while a call runs: tests poll this every fraction of a second, and a pooled
    engine per call held a connection each until garbage collection (PostgreSQL's 100 ran out)."""
    import optuna
    from optuna.storages import RDBStorage
    from sqlalchemy.pool import NullPool

    from sweeps.backends.optuna_storage import sqlalchemy_url

    storage = RDBStorage(sqlalchemy_url(url), skip_table_creation=True, engine_kwargs={"poolclass": NullPool})
    return optuna.load_study(study_name=name, storage=storage)


def running_trials(url: str) -> list[dict]:
    """RUNNING trials straight from the Optuna tables: [{number, worker, out_dir}] (empty before
    the tables exist)."""
    import psycopg2

    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT t.number, a.key, a.value_json FROM trials t JOIN trial_user_attributes a "
                        "ON a.trial_id = t.trial_id WHERE t.state = 'RUNNING' AND a.key IN ('worker', 'out_dir')")
            rows = cur.fetchall()
    except psycopg2.errors.UndefinedTable:
        return []
    finally:
        conn.close()
    found: dict[int, dict] = {}
    for number, key, value in rows:
        found.setdefault(number, {"number": number})[key] = json.loads(value)
    return list(found.values())
