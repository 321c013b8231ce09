"""Start ``sweeps run``'s Optuna workers before the spec is validated.

Validating a spec builds its task, which imports torch: about 2 s before the orchestrator knows
its worker slots. A worker's own start-up (imports, torch._dynamo, its warm-up) is the longest
part of a study's start, so the workers are started at once, from a raw read of the spec
(``resources.workers``, or on ``auto`` one per two CPU threads, as ``pool.plan_workers`` counts),
and told their slot (threads, beat file, tracking writer) with their go. ``OptunaBackend``
adopts them for its slots; any not adopted is killed when the command ends.

Only where a worker's devices need not be fixed before it starts: CUDA reads
``CUDA_VISIBLE_DEVICES`` once, when a process first touches CUDA, so early workers run
with no GPU visible, which suits a spec with ``devices: cpu`` or a machine without an NVIDIA
driver. This module imports nothing heavy: it runs before torch is imported.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Mapping

_PR_SET_PDEATHSIG = 1
_MOST = 64  # more early workers than this are not started before the plan confirms them
# A local worker's exit codes that `sweeps run` reads (besides 128 + a signal's number).
EXIT_OK, EXIT_MAX_FAILURES = 0, 3


def die_with_parent() -> None:
    """Runs in the child before exec: if the orchestrator dies (even by SIGKILL), so do its
    workers, and the next ``sweeps run`` finds their trials orphaned and requeues them."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclass
class LocalWorker:
    """A worker process and this process's ends of the pipe that serves its MLflow writes
    (``sweeps.tracking.writer.serve_in_thread``; unused if its go gives it a writer process)."""

    proc: subprocess.Popen
    tracking_ends: tuple[Connection, Connection]


_started: list[tuple[Path, LocalWorker]] = []


def spawn_worker(spec_path: str | Path, env: Mapping[str, str]) -> LocalWorker:
    """A local Optuna worker (``python -m sweeps.backends.optuna_worker SPEC``) with ``env`` on
    top of this process's environment. It validates the spec, warms up, then waits on its
    stdin for the go (``OptunaBackend._go``); it dies with this process."""
    from sweeps.tracking.writer import PIPE_VAR, open_served_pipe

    cmd = [sys.executable, "-m", "sweeps.backends.optuna_worker", str(spec_path)]
    child_fds, ends = open_served_pipe()
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, **env, PIPE_VAR: ",".join(map(str, child_fds))},
                                stdin=subprocess.PIPE, text=True, pass_fds=child_fds, preexec_fn=die_with_parent)
    except BaseException:
        for conn in ends:
            conn.close()
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
    return LocalWorker(proc, ends)


def start_early_workers(spec_path: str) -> None:
    """Start the workers of ``spec_path`` if the raw spec says it is an Optuna study that can
    train without GPUs chosen yet; otherwise do nothing (the backend starts its workers)."""
    import yaml

    from sweeps.pool import auto_cpu_workers, cpu_threads_available

    try:
        raw = yaml.safe_load(Path(spec_path).read_text())
    except Exception:  # unreadable or not YAML: validation says why, with the line
        return
    if not isinstance(raw, dict) or raw.get("backend", "optuna") != "optuna":
        return
    resources = raw.get("resources") if isinstance(raw.get("resources"), dict) else {}
    if resources.get("devices", "auto") != "cpu" and Path("/proc/driver/nvidia").exists():
        return
    workers = resources.get("workers", "auto")
    if workers == "auto":
        workers = auto_cpu_workers(cpu_threads_available())
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= _MOST:
        return  # validation reports a bad count; a huge one waits for the plan
    for _ in range(workers):
        _started.append((Path(spec_path).resolve(), spawn_worker(spec_path, {"CUDA_VISIBLE_DEVICES": ""})))


def adopt_early_worker(spec_path: str | Path) -> LocalWorker | None:
    """An early worker started for this spec file, still running, handed over once."""
    wanted = Path(spec_path).resolve()
    for i, (path, worker) in enumerate(_started):
        if path == wanted and worker.proc.poll() is None:
            del _started[i]
            return worker
    return None


def stop_early_workers() -> None:
    """Kill the early workers nobody adopted (the spec was invalid, or needs GPUs or Ray)."""
    while _started:
        _, worker = _started.pop()
        proc = worker.proc
        for conn in worker.tracking_ends:
            conn.close()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        proc.kill()
        proc.wait()
