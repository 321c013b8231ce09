"""Keep the MLflow store's writes out of the training process.

MLflow's SQL store spends about 0.1 to 0.15 ms of CPU per metric point in its ORM. Against a
small model's 3 to 6 ms step, three points a step cost 5 to 10% of training when the trainer
writes them itself, as a plain :class:`MlflowTracker` does (benchmarks/RESULTS.md, tracking
overhead). A :class:`WriterProcessTracker` only buffers points in the trainer (microseconds
each) and ships them every ``ship_every_s`` over a pipe to a child process, the writer
(``python -m sweeps.tracking.writer``). The writer runs an ordinary ``MlflowTracker`` and
writes on another core, batching whatever arrived while its previous write was in flight.
(W&B's client keeps its writer in a separate process for the same reason.)

The contract is MlflowTracker's. Every call except ``log_metrics`` and ``end_run`` is a
request the caller waits for, so its errors are raised where it was made. ``end_run`` (which
never raises for the store) hands the run's last points and status to the writer and returns:
the next trial starts while they are written, and ``flush`` waits for them. One pipe, read in
order, keeps the order of writes. The store's refusal of shipped points is logged by the writer
and raised by the next ``flush`` of that run (or of all runs).

The writer can also be a thread of another process: ``sweeps run`` serves the writes of its
local workers that have no core to spare for a writer of their own (:func:`open_served_pipe`,
:func:`serve_in_thread`; the worker finds its ends in its go message). The worker
then never imports MLflow, which ``sweeps run`` has imported already: 3 to 4 s less CPU
before its first trial.

If the writer dies, the tracker says so and writes from the trainer's process from then on
(the MlflowTracker it extends). Points shipped but not yet written are lost: at most the last
``ship_every_s`` of them, as an in-process tracker loses its unflushed buffer in a crash.
The writer ignores SIGINT and SIGTERM (a Ctrl-C to the process group must not stop it before
the trainer has ended its runs) and exits when its pipe closes, after writing what it holds.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from sweeps.errors import TrackingError
from sweeps.tracking.base import RunHandle, RunStatus
from sweeps.tracking.mlflow_tracker import MlflowTracker

log = logging.getLogger(__name__)

_PIPE_BYTES = 1 << 20  # room for seconds of points, so a busy writer does not stall the trainer
_F_SETPIPE_SZ = 1031  # Linux fcntl


class WriterProcessTracker(MlflowTracker):
    """An :class:`MlflowTracker` whose store writes happen in a child process.

    ``ship_every_s`` / ``ship_every_points``: ``log_metrics`` ships its buffer to the writer
    once it is this old or holds this many points. ``served_by``: the pipe ends (requests,
    replies) to a writer the parent process already runs (:func:`serve_in_thread`)
    instead of a child of this process. The other arguments are MlflowTracker's;
    ``client`` serves only reads made through ``.client`` in this process. Call
    :meth:`close` when done (the writer also ends by itself when this process ends).
    """

    def __init__(self, tracking_uri: str, ship_every_s: float = 0.1, ship_every_points: int = 500,
                 served_by: tuple[Connection, Connection] | None = None, **kwargs: Any) -> None:
        super().__init__(tracking_uri, flush_every_s=ship_every_s, flush_every_points=ship_every_points, **kwargs)
        self._pipe_lock = threading.Lock()  # one message on the pipe at a time; taken after _send_lock
        config = {"tracking_uri": self.tracking_uri, "spool_dir": str(self.spool.directory),
                  "artifact_root": self.artifact_root, "retry_interval_s": self.retry_interval_s}
        self._proc: subprocess.Popen | _ServingProcess | None = None
        if served_by is not None:  # a thread of the parent process writes (see serve_in_thread)
            self._requests, self._replies = served_by
            self._proc = _ServingProcess(os.getppid())
            return
        try:
            self._proc, self._requests, self._replies = _start_writer(config)
        except OSError as exc:  # no process to be had (out of memory, pids): write from this one
            log.warning("cannot start the MLflow writer process (%s); this process writes to %s itself",
                        exc, self.tracking_uri)

    def warm_up(self) -> None:
        """Nothing to do here: the writer imports MLflow in its own process as it starts."""

    @property
    def writer_pid(self) -> int | None:
        """The writer's pid; None once this process writes by itself."""
        return self._proc.pid if self._proc is not None else None

    # -- requests the caller waits for ---------------------------------------------------
    def check_connection(self) -> None:
        self._request("check_connection")

    def get_or_create_experiment(self, name: str) -> str:
        return self._request("get_or_create_experiment", name)

    def start_run(self, experiment_id, name, parent=None, tags=None):
        return self._request("start_run", experiment_id, name, parent, tags)

    def find_run(self, experiment_id, tags):
        return self._request("find_run", experiment_id, tags)

    def _submit(self, run_id: str, records: list[list[Any]], force: bool = False) -> None:
        self._request("_submit", run_id, records, force)

    def end_run(self, run: RunHandle, status: RunStatus = "FINISHED") -> None:
        """Hands the run's last points and its status to the writer and returns without
        waiting for the store: the writer ends the run as :meth:`MlflowTracker.end_run` does
        (one submission after everything shipped before it; what the store cannot take is
        spooled, with the warning), while the caller goes on to its next trial. On SQLite that
        wait was 12 to 18 ms a run, 1.5% of a one-second trial. :meth:`flush` waits for it."""
        with self._send_lock:
            points, end_ms = self._take_last(run, status)
            with self._pipe_lock:
                if self._proc is not None:
                    try:
                        self._requests.send(("end", run, status, points, end_ms))
                        return
                    except OSError as exc:
                        self._writer_gone(exc)
            self._end(run, status, points, end_ms)  # the writer is gone: end it from here

    def flush(self, run=None) -> None:
        """Ship this process's buffer, then wait until the writer has written everything
        shipped so far; raises what the store refused since the last flush."""
        super().flush(run)
        self._request("sync", run.run_id if run is not None else None)

    def close(self) -> None:
        """Write everything, then end the writer. The tracker keeps working, in this process."""
        try:
            self.flush()
        finally:
            with self._pipe_lock:
                proc, self._proc = self._proc, None
                if proc is not None:
                    try:
                        self._requests.send(("close",))
                        self._replies.recv()
                    except (OSError, EOFError):
                        pass  # it is gone already: nothing more to tell it
                    self._close_pipes()
                    try:
                        proc.wait(timeout=60)  # it exits as soon as it has answered
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()

    # -- shipping ------------------------------------------------------------------------
    def _flush_due(self) -> None:
        """log_metrics found the buffer due: hand it to the writer without waiting."""
        with self._send_lock:
            with self._lock:
                taken, self._buffer = self._buffer, {}
                self._n_buffered = 0
                self._last_flush = time.monotonic()
            if not taken:
                return
            with self._pipe_lock:
                if self._proc is not None:
                    try:
                        self._requests.send(("ship", taken))
                        return
                    except OSError as exc:
                        self._writer_gone(exc)
            for run_id, points in taken.items():  # the writer is gone: write them here
                MlflowTracker._submit(self, run_id, points)

    def _request(self, method: str, *args: Any) -> Any:
        with self._pipe_lock:
            if self._proc is not None:
                try:
                    self._requests.send(("call", method, args))
                    ok, value = self._replies.recv()
                except (OSError, EOFError) as exc:
                    self._writer_gone(exc)
                else:
                    if ok:
                        return value
                    raise value
        # Written from this process (the writer is gone); nothing was shipped to sync with.
        return None if method == "sync" else getattr(MlflowTracker, method)(self, *args)

    def _writer_gone(self, exc: BaseException) -> None:
        proc, self._proc = self._proc, None
        code = proc.poll() if proc is not None else None  # reaps it if it has exited
        self._close_pipes()
        log.error("the MLflow writer (pid %s) is gone (%s; exit code %s): this process writes to %s "
                  "from now on; points shipped to the writer in its last %.1f s may be missing",
                  proc.pid if proc else "?", exc, code, self.tracking_uri, self.flush_every_s)


    def _close_pipes(self) -> None:
        for conn in (self._requests, self._replies):
            try:
                conn.close()
            except OSError:
                pass


class _ServingProcess:
    """The parent process whose thread serves this tracker's pipe, in the place of a writer
    child: it is not this process's to wait for or kill; only the pipe says it is gone."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> None:
        return None

    def kill(self) -> None:
        pass


def open_served_pipe() -> tuple[tuple[int, int], tuple[Connection, Connection]]:
    """A pipe pair for a child process whose writes this process will serve: the child's fds
    (requests out, replies in; pass them with ``pass_fds`` and name them in the child's go
    message, then close them here) and this process's ends (requests in, replies out) for
    :func:`serve_in_thread`."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    try:
        fcntl.fcntl(req_w, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass
    return (req_w, rep_r), (Connection(req_r, writable=False), Connection(rep_w, readable=False))


def serve_in_thread(ends: tuple[Connection, Connection], make_tracker: Callable[[], MlflowTracker],
                    name: str) -> threading.Thread:
    """Serve one child's pipe (:func:`serve`) on a daemon thread of this process until the
    child closes it (it ended, or was killed) or says close; then the ends are closed, so a
    child still waiting learns that nobody serves it and writes by itself. Start it once this
    process has imported MLflow (two threads importing MLflow at once can deadlock)."""
    requests, replies = ends

    def run() -> None:
        try:
            serve(requests, replies, make_tracker())
        except Exception:  # noqa: BLE001 - the child falls back to writing by itself
            log.exception("serving the MLflow writes of %s failed; it writes by itself from now on", name)
        finally:
            for conn in ends:
                conn.close()

    thread = threading.Thread(target=run, name=f"mlflow-writer-{name}", daemon=True)
    thread.start()
    return thread


def _start_writer(config: dict) -> tuple[subprocess.Popen, Connection, Connection]:
    req_r, req_w = os.pipe()  # non-inheritable: only the writer holds the other ends
    rep_r, rep_w = os.pipe()
    try:
        fcntl.fcntl(req_w, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass  # a smaller pipe only means the trainer waits sooner for a busy writer
    try:
        proc = subprocess.Popen([sys.executable, "-m", "sweeps.tracking.writer", str(req_r), str(rep_w),
                                 json.dumps(config)], pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL)
    finally:
        os.close(req_r)
        os.close(rep_w)
    return proc, Connection(req_w, readable=False), Connection(rep_r, writable=False)


# ----------------------------------------------------------------------------- the writer
def serve(requests: Connection, replies: Connection, tracker: MlflowTracker) -> None:
    """Apply the trainer's messages in order until its pipe closes or it says close.
    Shipped points wait in ``pending`` only while more messages are queued: they are
    written (one batch per run) as soon as the pipe is empty, and before any request."""
    pending: dict[str, list] = {}
    refusals: dict[str, list[str]] = {}  # run id -> what the store refused of its shipped points

    def write_pending() -> None:
        for run_id in list(pending):
            try:
                tracker._submit(run_id, pending.pop(run_id))
            except TrackingError as exc:
                log.error("%s", exc)
                refusals.setdefault(run_id, []).append(str(exc))

    while True:
        if pending and not requests.poll(0):
            write_pending()
            continue
        try:
            msg = requests.recv()
        except EOFError:  # the trainer ended or died: write what it shipped, then go
            write_pending()
            return
        if msg[0] == "ship":
            for run_id, points in msg[1].items():
                pending.setdefault(run_id, []).extend(points)
            continue
        if msg[0] == "end":  # a run's last points and its status: nobody waits for an answer
            _, run, status, points, end_ms = msg
            try:  # its shipped points go with them, in order: one store transaction, not two
                tracker._end(run, status, pending.pop(run.run_id, []) + points, end_ms)
            except Exception:  # noqa: BLE001 - _end spools what the store cannot take; this is a bug
                log.exception("ending run %s (status %s) failed", run.run_id, status)
            continue
        write_pending()  # a request sees everything shipped before it
        if msg[0] == "close":
            replies.send((True, None))
            return
        _, method, args = msg
        if method == "sync":  # flush(run): what was refused of that run's points (or of all runs)
            runs = list(refusals) if args[0] is None else [args[0]]
            lines = [line for run_id in runs for line in refusals.pop(run_id, [])]
            reply = (False, TrackingError("\n".join(lines))) if lines else (True, None)
        else:
            try:
                reply = (True, getattr(tracker, method)(*args))
            except Exception as exc:
                reply = (False, _picklable(exc))
        replies.send(reply)


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return TrackingError(f"{type(exc).__name__}: {exc}")


def main(argv: list[str]) -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s [mlflow writer] %(message)s")
    requests, replies = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    config = json.loads(argv[2])
    # A trainer that ends before its first request (a sweep whose set-up failed) must not leave
    # the writer behind for the seconds its imports take: a watcher ends it if the parent goes.
    # (The imports stay on this thread: two threads importing MLflow at once can deadlock.)
    parent, importing = os.getppid(), threading.Event()
    importing.set()

    def leave_with_parent() -> None:
        while importing.is_set():
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.05)

    threading.Thread(target=leave_with_parent, daemon=True).start()
    tracker = MlflowTracker(config.pop("tracking_uri"), **config)
    tracker.warm_up()
    importing.clear()
    serve(requests, replies, tracker)
    return 0


if __name__ == "__main__":
    from sweeps.fast_exit import exit_now

    exit_now(main(sys.argv[1:]))
