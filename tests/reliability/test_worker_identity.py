"""A worker's name is host:boot-id:pid: unique across machines (not pid % 10000), the same in
the trial's Optuna attribute and MLflow tag, and the one its supervisor compares to find the
trial a dead worker left RUNNING."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from sweeps import worker_identity as identity
from sweeps.backends.supervisor import LocalWorker
from sweeps.slot_plan import WorkerSlot

ROOT = Path(__file__).resolve().parents[2]
# What a worker tags its trials with (sweeps/trial.py, sweeps/backends/optuna_worker.py).
PRINT_NAME = "from sweeps.worker_identity import worker_identity; print(worker_identity())"


def _name_in_child(env: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", PRINT_NAME], env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    out = proc.communicate(timeout=120)[0].strip()
    assert proc.returncode == 0, out
    return proc, out


def test_the_name_is_host_boot_id_and_pid(monkeypatch):
    monkeypatch.delenv(identity.ENV_BOOT_ID, raising=False)
    host, boot, pid = identity.worker_identity().rsplit(":", 2)
    assert (host, pid) == (socket.gethostname(), str(os.getpid()))
    kernel = identity.BOOT_ID_FILE.read_text().strip().replace("-", "")
    assert boot == kernel[:identity.BOOT_CHARS]


def test_two_machines_with_the_same_host_name_and_pid_get_different_names(monkeypatch):
    # Two containers or cloned VMs: same host name, same pid, different boots.
    monkeypatch.setenv(identity.ENV_BOOT_ID, "aaaa1111")
    first = identity.worker_identity(7)
    monkeypatch.setenv(identity.ENV_BOOT_ID, "bbbb2222")
    assert first != identity.worker_identity(7)


def test_without_a_kernel_boot_id_a_random_one_is_shared_with_child_processes(monkeypatch, tmp_path):
    monkeypatch.delenv(identity.ENV_BOOT_ID, raising=False)
    monkeypatch.setattr(identity, "BOOT_ID_FILE", tmp_path / "missing")
    mine = identity.boot_id()
    assert len(mine) == identity.BOOT_CHARS and os.environ[identity.ENV_BOOT_ID] == mine
    assert identity.boot_id() == mine  # settled once per process
    # A worker started afterwards (a real process) names itself as its supervisor names it.
    proc, name = _name_in_child(dict(os.environ))
    assert name == identity.worker_identity(proc.pid) == f"{socket.gethostname()}:{mine}:{proc.pid}"


def test_the_supervisor_names_a_worker_as_the_worker_names_itself(tmp_path):
    proc, name = _name_in_child(dict(os.environ))
    worker = LocalWorker(WorkerSlot(0, (), 1), proc, tmp_path / "beat")
    assert worker.name == name
