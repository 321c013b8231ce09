"""The name a worker process goes by in a study: ``host:boot:pid``.

Every trial records the name of the process that ran it (Optuna user attribute ``worker``,
MLflow tag ``sweeps.worker``), and ``sweeps run`` finds the trials a dead local worker left
RUNNING by comparing these names. A pid alone repeats across machines, and a host name alone
repeats across containers and cloned VMs, so the name also carries the kernel's boot id (a
random UUID the kernel draws at every boot, the same for every process of one boot of one
machine). Where the kernel has none, a random UUID stands in; it is exported so that the
processes this one starts (a supervisor's workers) use the same one and so name the same
process the same way. Stdlib only: cheap to import anywhere.
"""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
ENV_BOOT_ID = "SWEEPS_BOOT_ID"  # inherited by child processes when the kernel gives no boot id
BOOT_CHARS = 8  # of the boot id's hex digits: enough to tell boots apart, short enough to read


def boot_id() -> str:
    """The first ``BOOT_CHARS`` hex digits of this boot's id (or of an inherited stand-in)."""
    inherited = os.environ.get(ENV_BOOT_ID, "").strip()
    if inherited:
        return inherited
    try:
        text = BOOT_ID_FILE.read_text().strip().replace("-", "")
    except OSError:
        text = ""
    if not text:  # no /proc (macOS, some sandboxes): one stand-in shared with this process's children
        text = uuid.uuid4().hex
        os.environ[ENV_BOOT_ID] = text[:BOOT_CHARS]
    return text[:BOOT_CHARS]


def worker_identity(pid: int | None = None) -> str:
    """``host:boot:pid`` of the process ``pid`` on this machine (default: this process)."""
    return f"{socket.gethostname()}:{boot_id()}:{os.getpid() if pid is None else pid}"
