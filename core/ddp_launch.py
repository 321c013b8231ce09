"""Run one ``core.train`` on N local processes (DDP), with the reporter kept in this process.

The calling process is the *reporter host*: it starts N rank processes, serves rank 0's
``report_step`` / ``report_epoch`` / ``resumed`` / ``log_artifact`` calls on the real reporter (an MLflow
tracker, an Optuna trial) and sends each decision back; rank 0 broadcasts it to the other
ranks (``DistContext.agree`` in ``core/distributed.py``), so a pruned or interrupted trial stops
every rank at the same step. Rank 0's ``TrainResult`` comes back to the caller.

    parent (reporter host) --socketpair--> rank 0: train(task, cfg, _ForwardingReporter)
                           --socketpair--> rank 1..N-1: train(task, cfg)
                           TCPStore (port picked by the OS) <- rendezvous of all ranks

Why not ``torch.distributed.launcher.api.elastic_launch``: its process context installs
SIGTERM/SIGINT handlers in the calling process and does not restore them (they would replace a
sweep worker's "checkpoint and requeue" handler), and its agent blocks the calling thread,
which is the thread that has to answer rank 0. Here each rank is a plain
``python -c 'from core.ddp_launch import _rank_main'`` subprocess with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_USE_AGENT_STORE), so
``init_from_env`` joins it exactly as under torchrun; the store lives in this process (as the
elastic agent's does), so no port is guessed and no rank must outlive the others to serve it.

Failure handling: each rank runs in its own process group and session (terminal Ctrl-C reaches
only this process, which decides), dies with this process (PR_SET_PDEATHSIG), and sends its
exception before exiting. A rank that fails or dies ends the run with :class:`RankFailedError`
("rank 1 failed: RuntimeError: ..."); the surviving ranks' process groups are then killed and
reaped, so nothing is left behind.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from core.config import ConfigError, TrainConfig, validate
from core.reporting import Decision, EpochReport, NullReporter, Reporter, StepReport
from core.results import TrainResult
from core.tasks.base import Task, make_task

_FD_ENV, _PARENT_ENV = "SWEEPS_DDP_FD", "SWEEPS_DDP_PARENT_PID"
_ROOT = str(Path(__file__).resolve().parents[1])  # the folder holding the `core` package
_FAILURE_GRACE_S = 2.0  # after a first failure: time to hear from the other ranks (to name the cause)
_EXIT_GRACE_S = 60.0  # after rank 0's result: time for the other ranks to leave on their own
# Words in the errors a rank raises because *another* rank went away (the collective broke):
# such a rank is named as the cause only when no rank failed for a reason of its own.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
              "gloo", "nccl")


@dataclass
class TaskSpec:
    """A picklable recipe for :func:`core.tasks.make_task` (a spec's ``task:`` section); every
    rank builds its own task from it."""

    name: str | None = None
    target: str | None = None
    model: str | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Task:
        return make_task(self.name, target=self.target, model=self.model, args=self.args)


class RankFailedError(RuntimeError):
    """A rank raised or died; ``rank`` is the root cause, ``failures`` every rank heard from."""

    def __init__(self, rank: int, error: str, failures: dict[int, str], details: str = "") -> None:
        others = "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()) if r != rank)
        message = f"rank {rank} failed: {error}"
        if others:
            message += f"\nother ranks: {others}"
        if details:
            message += "\n" + details
        super().__init__(message)
        self.rank, self.error, self.failures = rank, error, failures


@dataclass
class _Payload:
    """What each rank receives over its socket once started."""

    task: TaskSpec | Task
    cfg: TrainConfig
    out_dir: str | None
    resume: bool
    threads: int
    owner: str | None = None


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    conn: Connection | None
    exit_code: int | None = None
    error: str | None = None  # first line: "RuntimeError: boom"
    details: str = ""  # the rank's traceback
    peer_lost: bool = False  # its error is a consequence of another rank's failure
    failed_time: float = 0.0  # when the parent heard of the failure (orders the causes)
    result: TrainResult | None = None


def train_distributed(task: TaskSpec | Task, cfg: TrainConfig, reporter: Reporter | None = None,
                      out_dir: str | Path | None = None, resume: bool = False,
                      owner: str | None = None) -> TrainResult:
    """Train on ``cfg.distributed.nproc`` local processes and return rank 0's result.

    ``task`` is a :class:`TaskSpec` (rebuilt in every rank) or a picklable Task object.
    ``reporter`` stays in this process and hears exactly what a single-process ``train()``
    would tell it. ``owner`` is ``train``'s: every rank refuses a checkpoint of another owner.
    With ``nproc == 1`` this is a plain in-process ``core.train.train``.
    Raises :class:`RankFailedError` when a rank fails; no rank process outlives the call.
    """
    validate(cfg)
    reporter = reporter or NullReporter()
    nproc = cfg.distributed.nproc
    if nproc == 1:
        from core.train import train  # lazy: a rank imports this module before it sets its threads

        return train(task.build() if isinstance(task, TaskSpec) else task, cfg, reporter, out_dir, resume, owner)
    _check_devices(cfg)
    payload = _Payload(task, cfg, str(Path(out_dir).resolve()) if out_dir is not None else None, resume,
                       threads=max(1, _threads() // nproc), owner=owner)
    try:
        blob = pickle.dumps(payload)
    except Exception as exc:  # noqa: BLE001 - explain what to pass instead
        raise ConfigError(f"train.distributed: the task {task!r} cannot be sent to the rank processes "
                          f"({type(exc).__name__}: {exc}); pass a core.ddp_launch.TaskSpec instead") from exc

    from torch.distributed import TCPStore

    # The rendezvous store lives here, on a port the OS picks: nothing to guess, nothing to collide.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks: list[_Rank] = []
    try:
        for rank in range(nproc):
            ranks.append(_start_rank(rank, nproc, store.port, blob))
        return _serve(ranks, reporter)
    finally:
        _stop_all(ranks)
        del store


def _check_devices(cfg: TrainConfig) -> None:
    import torch

    from core.distributed import resolve_backend  # lazy for start-up: torch.distributed

    backend = resolve_backend(cfg.distributed.backend, cfg.device)
    wants_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if backend == "nccl" and not wants_cuda:
        raise ConfigError(f"train.distributed.backend: 'nccl' needs CUDA but the run trains on {cfg.device!r}; "
                          "use backend: gloo (or auto)")
    if wants_cuda and cfg.device not in ("auto", "cuda"):
        raise ConfigError(f"train.device: {cfg.device!r} would put all {cfg.distributed.nproc} ranks on one GPU; "
                          "use device: cuda (rank r takes GPU r of CUDA_VISIBLE_DEVICES)")
    if wants_cuda:
        visible = torch.cuda.device_count()
        if cfg.distributed.nproc > visible:
            raise ConfigError(
                f"train.distributed.nproc: {cfg.distributed.nproc} processes need one GPU each but "
                f"{visible} are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                "lower nproc or raise resources.gpus_per_trial")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _start_rank(rank: int, nproc: int, port: int, blob: bytes) -> _Rank:
    parent_sock, child_sock = socket.socketpair()
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank is a client of the store above
        _FD_ENV: str(child_sock.fileno()), _PARENT_ENV: str(os.getpid()),
        "PYTHONPATH": os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
    })
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from core.ddp_launch import _rank_main; _rank_main()"],
            env=env, pass_fds=[child_sock.fileno()],
            start_new_session=True,  # own process group: killed as a group, no terminal signals
        )
    finally:
        child_sock.close()
    conn = Connection(parent_sock.detach())
    conn.send([p if p else os.getcwd() for p in sys.path])  # import the task's module like this process does
    conn.send_bytes(blob)
    return _Rank(rank, proc, conn)


def _serve(ranks: list[_Rank], reporter: Reporter) -> TrainResult:
    """Answer rank 0, watch every rank; return rank 0's result or raise for the first failure."""
    failed_at: float | None = None
    done_at: float | None = None
    while True:
        open_conns = [r.conn for r in ranks if r.conn is not None]
        if open_conns:
            ready = wait(open_conns, timeout=0.1)  # a message, or 0.1 s to notice a silent death
        else:
            ready = []
            time.sleep(0.1)
        for r in ranks:
            if r.conn is not None and r.conn in ready:
                _receive(r, reporter)
        for r in ranks:
            if r.exit_code is None and r.proc.poll() is not None:
                r.exit_code = r.proc.returncode
                _drain(r, reporter)  # its last words (the error) may still sit in the socket
                if r.exit_code != 0 and r.error is None:
                    r.error, r.failed_time = _describe_exit(r.exit_code), time.monotonic()
        now = time.monotonic()
        if any(r.error is not None for r in ranks):
            failed_at = failed_at or now
            everyone_heard = all(r.exit_code is not None or r.error is not None for r in ranks)
            if everyone_heard or now - failed_at > _FAILURE_GRACE_S:
                _raise_failure(ranks)
        if ranks[0].result is not None:
            done_at = done_at or now
            if all(r.exit_code is not None for r in ranks) or now - done_at > _EXIT_GRACE_S:
                return ranks[0].result
        elif ranks[0].exit_code == 0:
            _raise_failure(ranks, fallback=(0, "exited without sending its result"))


def _receive(r: _Rank, reporter: Reporter) -> None:
    assert r.conn is not None
    try:
        msg = r.conn.recv()
    except (EOFError, OSError):
        r.conn.close()
        r.conn = None
        return
    kind = msg[0]
    if kind == "step":
        r.conn.send(reporter.report_step(msg[1], msg[2]).value)
    elif kind == "epoch":
        r.conn.send(reporter.report_epoch(msg[1], msg[2], msg[3]).value)
    elif kind == "resumed":
        reporter.resumed(msg[1], msg[2])
        r.conn.send(None)
    elif kind == "artifact":
        reporter.log_artifact(Path(msg[1]), msg[2])
        r.conn.send(None)
    elif kind == "result":
        r.result = msg[1]
    elif kind == "error":
        r.error, r.details, r.peer_lost, r.failed_time = msg[1], msg[2], msg[3], time.monotonic()


def _drain(r: _Rank, reporter: Reporter) -> None:
    while r.conn is not None and r.conn.poll(0.05):
        _receive(r, reporter)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (no Python error; out of host memory or killed from outside?)"
    return f"process exited with code {code} without a Python error (os._exit, a crash in native code?)"


def _raise_failure(ranks: list[_Rank], fallback: tuple[int, str] | None = None) -> None:
    failures = {r.rank: r.error for r in ranks if r.error is not None}
    failed = sorted((r for r in ranks if r.error is not None), key=lambda r: r.failed_time)
    causes = [r for r in failed if not r.peer_lost] or failed
    if causes:
        cause = causes[0]
        raise RankFailedError(cause.rank, failures[cause.rank], failures, _tail(cause.details))
    assert fallback is not None
    raise RankFailedError(fallback[0], fallback[1], failures)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _stop_all(ranks: list[_Rank]) -> None:
    """Kill every rank's process group (the rank and any DataLoader workers) and reap the ranks."""
    for r in ranks:
        if r.proc.poll() is None:
            _killpg(r.proc.pid, signal.SIGKILL)
    for r in ranks:
        try:
            r.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not time out in practice
            pass
        _killpg(r.proc.pid, signal.SIGKILL)  # stray DataLoader workers of an exited rank
        if r.conn is not None:
            r.conn.close()
            r.conn = None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- inside a rank process

class _ForwardingReporter:
    """Rank 0's reporter: every call is answered by the real reporter in the parent. One local
    round trip per optimizer step, next to the step's own collectives (loss all-reduce, decision
    broadcast), so the loop keeps the exact single-process semantics ("INTERRUPT stops at this step")."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def report_step(self, step: int, metrics: dict[str, float]) -> Decision:
        self.conn.send(("step", step, dict(metrics)))
        return Decision(self.conn.recv())

    def report_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> Decision:
        self.conn.send(("epoch", epoch, step, dict(metrics)))
        return Decision(self.conn.recv())

    def resumed(self, epochs: list[EpochReport], steps: list[StepReport]) -> None:
        self.conn.send(("resumed", epochs, steps))
        self.conn.recv()

    def log_artifact(self, path: Path, kind: str) -> None:
        self.conn.send(("artifact", str(path), kind))
        self.conn.recv()


def _die_with_parent(parent_pid: int) -> None:
    """The kernel kills this rank when the parent dies (even by SIGKILL): no orphaned ranks."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's finally still kills the group
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _is_peer_lost(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(s in text for s in _PEER_LOST)


def _rank_main() -> None:
    """Entry point of a rank process (see ``_start_rank``)."""
    _die_with_parent(int(os.environ[_PARENT_ENV]))
    conn = Connection(int(os.environ.pop(_FD_ENV)))
    sys.path[:] = conn.recv()
    code = 1
    try:
        payload: _Payload = pickle.loads(conn.recv_bytes())
        import torch

        torch.set_num_threads(payload.threads)  # N ranks share this trial's CPU threads
        from core.train import train  # lazy: a rank imports this module before it sets its threads

        task = payload.task.build() if isinstance(payload.task, TaskSpec) else payload.task
        reporter = _ForwardingReporter(conn) if int(os.environ["RANK"]) == 0 else None
        result = train(task, payload.cfg, reporter, payload.out_dir, payload.resume, payload.owner)
        if reporter is not None:
            conn.send(("result", result))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent, then this rank exits
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
        summary = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        try:
            conn.send(("error", summary, traceback.format_exc()[-8000:], _is_peer_lost(exc)))
        except OSError:
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    conn.close()
    # Skip interpreter teardown either way: a broken process group can block it, and even a
    # clean one can abort ("terminate called without an active exception") when gloo's C++
    # threads are destroyed while a peer is already gone.
    os._exit(code)
