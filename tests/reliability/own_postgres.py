"""A private PostgreSQL server for tests that restart it (``initdb`` + ``pg_ctl`` on a free port,
trust auth, its data in a temporary folder): never the shared server on 5432."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnPostgres:
    def __init__(self) -> None:
        if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
            pytest.fail("initdb and pg_ctl (PostgreSQL's server binaries) must be on PATH for this test")
        self.root = Path(tempfile.mkdtemp(prefix="sweeps-own-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        # initdb refuses to run as root: the server then runs as the system's postgres user.
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()

    def _run(self, *args: str) -> None:
        proc = subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{args[0]} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "start")

    def stop(self) -> None:
        """As a crash or a failover does: every connection is cut at once (``-m immediate``)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def psql(self, sql: str, user: str = "postgres") -> None:
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", user, "-d", "postgres",
                  "-v", "ON_ERROR_STOP=1", "-c", sql)

    def close(self) -> None:
        subprocess.run([*self._as, "pg_ctl", "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(self.root, ignore_errors=True)

