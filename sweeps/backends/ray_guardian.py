"""No Ray process outlives the ``sweeps run`` that started a local Ray for its study.

``ray.init`` gives its GCS and raylet the driver's fate (``PR_SET_PDEATHSIG``), but the
raylet's agents (dashboard and runtime-env agents) only notice a dead raylet after a minute or
two, and a trial actor trains on for seconds, logging into MLflow. So before ``ray.init`` the
driver starts a guardian: a small process in its own session (a Ctrl-C to the terminal does not
reach it) that waits for the driver's end on a pipe, which the kernel closes however the driver
ends (exit, SIGTERM, SIGKILL, the OOM killer), then kills every process started with the
driver's mark in its environment (Ray's processes inherit it) and every process it saw below
those (Ray's agents overwrite their environment with their title), until none is left.
On a clean end the driver shuts Ray down, closes the pipe and waits for the guardian: when
``sweeps run`` returns, its Ray processes are gone.

Run as ``python -m sweeps.backends.ray_guardian MARK``; stdlib only (it starts in a blink).
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ENV_MARK = "SWEEPS_RAY_DRIVER"


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, start time, state) of every process, from /proc/<pid>/stat."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(entry.name)] = (int(fields[1]), fields[19], fields[0])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def marked_pids(mark: str, skip: set[int]) -> list[int]:
    """Live processes (not zombies) whose environment holds ``ENV_MARK=mark``. (Ray's agents
    overwrite their environment with their process title: they are found by descent.)"""
    needle = f"{ENV_MARK}={mark}".encode() + b"\0"
    found = []
    for pid, (_, _, state) in _processes().items():
        if pid in skip or state in ("Z", "X"):
            continue
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
                found.append(pid)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def ray_processes(mark: str, skip: set[int]) -> dict[int, str]:
    """The marked processes and their live descendants: pid -> start time (with the pid, it
    names a process). Only those: the driver's other children are none of the guardian's business."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, str] = {}
    todo = marked_pids(mark, skip)
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in skip and procs[pid][2] not in ("Z", "X"):
            out[pid] = procs[pid][1]
        todo.extend(children.get(pid, []))
    return out


def kill_all(mark: str, seen: dict[int, str], skip: set[int], rounds: int = 100) -> None:
    """SIGKILL the marked processes and those seen below the driver (if still the same
    process), until none is left (a dying raylet may still start one)."""
    for _ in range(rounds):
        procs = _processes()
        pids = set(ray_processes(mark, skip))
        pids |= {pid for pid, started in seen.items() if pid in procs and procs[pid][1] == started
                 and procs[pid][2] not in ("Z", "X") and pid not in skip}
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


class Guardian:
    """The driver's handle: :meth:`start` before ``ray.init`` (which then passes the mark on to
    every Ray process), :meth:`finish` after ``ray.shutdown``."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex
        self._proc: subprocess.Popen | None = None
        self._old: str | None = None

    def start(self) -> Guardian:
        # While its Ray runs, the driver is a child subreaper: a Ray process whose parent ends
        # first (a task worker of the raylet) is handed to the driver, not to pid 1 (which, in a
        # container without an init, never reaps it), and ``finish`` reaps it.
        _set_child_subreaper(True)
        env = {k: v for k, v in os.environ.items() if k != ENV_MARK}
        self._proc = subprocess.Popen([sys.executable, "-m", "sweeps.backends.ray_guardian", self.mark],
                                      stdin=subprocess.PIPE, env=env, start_new_session=True)
        self._old = os.environ.get(ENV_MARK)
        os.environ[ENV_MARK] = self.mark  # inherited by the processes ray.init starts
        return self

    def started_ray(self) -> None:
        """Ray is up: processes this driver starts from now on are not Ray's."""
        if self._old is None:
            os.environ.pop(ENV_MARK, None)
        else:
            os.environ[ENV_MARK] = self._old

    def finish(self) -> None:
        """Called after ``ray.shutdown``: the guardian kills what is left of this Ray; then the
        Ray processes handed to this driver are reaped (the driver starts no other process
        while its Ray runs, so its zombie children are Ray's)."""
        self.started_ray()
        if self._proc is None:
            return
        assert self._proc.stdin is not None  # stdin=PIPE
        self._proc.stdin.close()
        self._proc.wait()
        self._proc = None
        _reap_zombie_children()
        _set_child_subreaper(False)


_PR_SET_CHILD_SUBREAPER = 36


def _set_child_subreaper(on: bool) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on))
    except OSError:
        pass  # not Linux: orphans go to pid 1 as before


def _reap_zombie_children() -> None:
    me = os.getpid()
    for pid, (ppid, _, state) in _processes().items():
        if ppid == me and state == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # reaped meanwhile


def main(mark: str) -> int:
    driver = os.getppid()
    skip = {os.getpid(), driver}
    seen: dict[int, str] = {}  # Ray's processes as seen while the driver lived: its agents outlive the raylet
    try:
        while not select.select([sys.stdin], [], [], 0.5)[0]:
            seen.update(ray_processes(mark, skip))
        sys.stdin.buffer.read()  # returns when the driver closes the pipe or dies
    except (OSError, KeyboardInterrupt):
        pass
    kill_all(mark, seen, skip)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
