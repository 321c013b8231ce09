"""``sweeps run``'s local workers, forked from one process that imported what every trial uses.

A worker of its own (``supervisor.spawn_worker``) is a fresh interpreter importing seconds of
torch, MLflow and core.train, and ``sweeps run`` starts one per slot while the driver imports its
own: on two cores, three interpreters importing at once. Here the driver starts
:mod:`multiprocessing`'s fork server as soon as it has read its spec (:func:`start`), before it
imports anything heavy; the server imports the trials' modules once (this module is its preload:
:func:`_boot_server`) on the core the driver leaves idle, and each worker is a fork of it
(:func:`fork_worker`) that shares those pages and starts at once.

What a forked worker keeps of a worker process of its own:

* its go: one :class:`~sweeps.backends.worker_protocol.WorkerGo` line on a pipe
  (``ForkedWorker.stdin``, as a process's stdin), EOF meaning stop;
* it dies with the driver: the server sets PR_SET_PDEATHSIG first thing (SIGKILL when the driver
  dies, SIGKILL included), and each worker the same towards the server; the driver kills and
  reaps the server when its run ends (:func:`running`), or when the last study it keeps the
  server for has (:func:`kept_between_studies`);
* its environment: the driver's when it is forked plus its slot's (``CUDA_VISIBLE_DEVICES``,
  thread counts), set before anything touches CUDA (importing torch does not initialise it); the
  thread pools the server loaded (torch's, numpy's OpenBLAS) are sized to the slot at the go;
* its signals: SIGINT, SIGTERM and SIGHUP end it quietly (128 + n) until it has its go, as they
  end the server while it imports (``SWEEPS_PAUSE=worker_importing`` stops the server there).
  Once imported the server blocks them: a signal to the process group (Ctrl-C, ``kill -TERM
  -PGID``, a scheduler's SIGTERM) is for the workers, which checkpoint, and the server leaves
  with the driver. A worker unblocks them first thing; one that came meanwhile is delivered then;
* its exit code, read by the server and passed to the driver; ``ps`` (``ps -o comm``, ``top``,
  psutil's ``name()``) shows ``sweeps-worker-N``, the server ``sweeps-forksrv``;
* its working directory, ``sys.path`` and standard output and error: the driver's when it is
  forked (multiprocessing sends the first two with each fork, and here the driver's descriptors 1
  and 2 go with them), not the server's, which works in ``/`` once it has imported, so that it
  keeps no study folder busy.

A process that runs several studies one after another (a notebook, a script looping over specs, a
test suite) can keep one server for all of them (:func:`kept_between_studies`): each study's
workers are forked from the same imported server instead of one importing anew per study. A study
run from another thread stops the server when it ends (PR_SET_PDEATHSIG follows the thread that
started the server). What no fork receives stays as the first study left it: the server's own
standard streams (where it reports a failed import), its umask, limits and CPU affinity, and what
libraries read from the environment as the server imported them (``TORCH_LOGS``, say).

Everything that reaches into :mod:`multiprocessing` is here, its private parts included
(:func:`stop`). Stdlib only at import: the driver imports this before anything heavy.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import IO, Any, Protocol

from core.faults import Pause, pause_here
from sweeps.errors import BackendError
from sweeps.stop_signals import STOP_SIGNALS

WORKER_MODULE = "sweeps.backends.optuna_worker"
AUDIT_START = "sweeps.worker_forkserver.start"
ENV_SERVER_PARENT = "SWEEPS_FORKSERVER_PARENT"  # set only for the server: the driver's pid
# multiprocessing runs the driver's main module again in each fork (as ``__mp_main__``, for what it
# unpickles): ``sweeps`` and ``python -m sweeps.cli`` both import the CLI, imported here once instead.
DRIVER_MAIN = ("sweeps.cli",)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
_NO_STATUS = 255  # multiprocessing's exit code for a forked process whose server sent none
_SERVER_EXIT_S = 5.0  # how long a server that closed a worker's pipe unanswered may take to exit
_CONTEXT = multiprocessing.get_context("forkserver")
_server_pid: int | None = None  # in the server and the workers it forks: the server's pid
_forked_any = False  # in the driver: whether a server has forked a worker
_kept = 0  # in the driver: how many kept_between_studies() scopes are open


class ServerGone(BackendError):
    """The fork server exited before it forked the worker asked for: a signal while it imported
    (the driver has it too), the OOM killer, or an import that failed (its messages are above)."""


class WorkerProcess(Protocol):
    """What the supervisor holds of a worker: the part of :class:`subprocess.Popen` it uses."""

    pid: int
    stdin: IO[str] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when its parent dies (even by SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _name_process(name: str) -> None:
    """The name ``ps -o comm``, ``top`` and psutil show (15 characters at most)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])
    except OSError:
        pass


def _quiet_exit(signum, _frame) -> None:
    os._exit(128 + signum)  # before the go there is no trial to save, nor anything to say


def _boot_server() -> None:
    """The server, importing this module as its preload: it dies with the driver, leaves quietly on
    a signal while it imports, imports what every trial uses, then blocks the stop signals."""
    global _server_pid
    for signum in STOP_SIGNALS:
        signal.signal(signum, _quiet_exit)
    die_with_parent()
    if str(os.getppid()) != os.environ.pop(ENV_SERVER_PARENT):
        os._exit(0)  # the driver died before the line above: nobody will ask for a worker
    _server_pid = os.getpid()
    _name_process("sweeps-forksrv")
    pause_here(Pause.WORKER_IMPORTING)
    # Lazy, for start-up time: the driver imports this module before anything heavy; only the
    # server loads the worker and what its trials use.
    try:
        worker = importlib.import_module(WORKER_MODULE)
        for module in (*worker.TRIAL_IMPORTS, *DRIVER_MAIN):
            importlib.import_module(module)
    except ImportError as exc:  # multiprocessing would swallow it and serve half-set-up workers
        print(f"sweeps: the workers' fork server cannot import {exc.name or 'a module'}: {exc}", file=sys.stderr,
              flush=True)
        os._exit(1)
    for module in DRIVER_MAIN:  # runpy warns when it runs an imported module again: here that is the point
        warnings.filterwarnings("ignore", f"'{module}' found in sys.modules", RuntimeWarning)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    sys.stdout.flush()  # what the imports printed is written once, not again by every forked worker
    sys.stderr.flush()
    os.chdir("/")  # each worker works in the driver's folder at its fork (multiprocessing moves it)


def start() -> None:
    """Start the fork server unless it runs: at once, without waiting for its imports. Call it
    from the driver's main thread: the server's PR_SET_PDEATHSIG follows the thread that started
    it, and would kill it when another thread ended. Raises the
    audit event ``sweeps.worker_forkserver.start`` (multiprocessing starts it with no audit event
    of its own, where ``subprocess.Popen`` has one), so that an audit hook sees the study start."""
    sys.audit(AUDIT_START, os.getpid())
    _CONTEXT.set_forkserver_preload([__name__])
    os.environ[ENV_SERVER_PARENT] = str(os.getpid())  # read and dropped by the server only
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(ENV_SERVER_PARENT, None)


def stop() -> None:
    """Kill the server (and with it any worker still there) and reap it: when the driver's study
    ends, nothing it started outlives it, not even for the moment a server takes to notice."""
    server: Any = multiprocessing.forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()  # closes the driver's end of its pipe, reaps it, forgets it: start() makes a new one


@contextlib.contextmanager
def running() -> Iterator[None]:
    """The server from :func:`start` (now, or already) to :func:`stop` on leaving, unless a
    :func:`kept_between_studies` scope keeps it and this is the main thread."""
    start()
    try:
        yield
    finally:
        if not (_kept and threading.current_thread() is threading.main_thread()):
            stop()


@contextlib.contextmanager
def kept_between_studies() -> Iterator[None]:
    """Keep the server that a study started from the main thread for the studies that follow, to
    :func:`stop` it when the outermost such scope ends. Starts nothing by itself."""
    global _kept
    _kept += 1
    try:
        yield
    finally:
        _kept -= 1
        if not _kept:
            stop()


class _DriverFd:
    """A file descriptor of the driver, pickled as the forked worker's copy of it: the fork server
    sends it with the fork as it sends the go pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False  # a driver started with it closed: the worker keeps the server's
    return True


def _worker_main(go: multiprocessing.connection.Connection, env: dict[str, str], slot: int, out: int | None,
                 err: int | None) -> None:
    """A forked worker, before its go (multiprocessing has moved it to the driver's folder and
    ``sys.path``): it takes the driver's environment and its slot's and standard output and error,
    names itself, unblocks the stop signals (its quiet handlers are the server's), then runs the
    worker."""
    die_with_parent()
    if _server_pid is not None and os.getppid() != _server_pid:
        os._exit(128 + signal.SIGKILL)  # the server (so the driver) died before the line above
    for fd, target in ((out, 1), (err, 2)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)  # a trial's DataLoader forks as in a process of its own
    _name_process(f"sweeps-worker-{slot}")
    for signum in STOP_SIGNALS:
        signal.signal(signum, _quiet_exit)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    from sweeps.backends import optuna_worker  # the server's: imported before the fork
    from sweeps.fast_exit import exit_now

    stream = os.fdopen(os.dup(go.fileno()), "r")
    go.close()
    exit_now(optuna_worker.main(stream))


class ForkedWorker:
    """The driver's handle on a forked worker, used as the supervisor uses a ``Popen``."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdin: IO[str], server_pid: int) -> None:
        self._process = process
        self.pid: int = process.pid or 0
        self.stdin: IO[str] | None = stdin
        self._server_pid = server_pid

    def poll(self) -> int | None:
        return self._status(self._process.exitcode)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._status(self._process.exitcode)
        if code is None:
            raise subprocess.TimeoutExpired(f"sweeps-worker {self.pid}", timeout or 0.0)
        return code

    def _status(self, code: int | None) -> int | None:
        """The exit status as a process of its own would give it. A worker dies with its server
        (PR_SET_PDEATHSIG: SIGKILL), and multiprocessing, which hears of it from the server, then
        says 255: it is told as the SIGKILL it was, so its trial is requeued as after any kill
        instead of failing as a worker that exited with an error."""
        if code == _NO_STATUS and _ends(self._server_pid):
            return -signal.SIGKILL
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _ends(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie within a few seconds: a server that closed a
    worker's pipe without its status is on its way out (it closes its files before it is a
    zombie), while one that is alive then sent a genuine 255."""
    deadline = time.monotonic() + _SERVER_EXIT_S
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (OSError, IndexError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def fork_worker(env: dict[str, str], slot: int) -> ForkedWorker:
    """A worker forked from the server (started now if :func:`start` has not, or again if it has
    exited), with ``env`` as its whole environment; it waits for its go on ``stdin``. Blocks while
    the server imports; raises :class:`ServerGone` if it exits first. A server that forked workers
    before and is found gone now (the OOM killer's pick: its workers died with it) is replaced by
    a new one once; one that never forked a worker exited for a reason it has said."""
    global _forked_any
    try:
        worker = _fork(env, slot)
    except ServerGone:
        if not _forked_any:
            raise
        worker = _fork(env, slot)
    _forked_any = True
    return worker


def _fork(env: dict[str, str], slot: int) -> ForkedWorker:
    start()
    go_r, go_w = _CONTEXT.Pipe(duplex=False)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()  # what the driver printed before, ahead of what the worker prints
    fds = [_DriverFd(fd) if _is_open(fd) else None for fd in (1, 2)]
    process = _CONTEXT.Process(target=_worker_main, args=(go_r, env, slot, *fds),
                               name=f"sweeps-worker-{slot}")
    try:
        process.start()
    except (EOFError, OSError) as exc:  # no pid came back, or nothing listens any more
        go_w.close()
        stop()  # reaped now: it may close its socket a moment before it can be reaped
        raise ServerGone(f"the fork server of the workers exited before it forked worker {slot} "
                         f"({type(exc).__name__}: {exc}); see the messages above") from exc
    finally:
        go_r.close()  # the worker has its own copy now
    stdin = os.fdopen(os.dup(go_w.fileno()), "w")
    go_w.close()
    server: Any = multiprocessing.forkserver._forkserver
    return ForkedWorker(process, stdin, server._forkserver_pid or 0)


if os.environ.get(ENV_SERVER_PARENT):  # only in the fork server (see start)
    _boot_server()
