"""Ray itself, for the Ray backend's driver: start it locally or join a cluster, make a
user's task importable in the trial actors, keep Ray's own console output to what helps
a ``sweeps run`` user, and stop a fit the resumable way (SIGTERM, ``budget.timeout``)."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from sweeps.backends.driver import DriverSignals
from sweeps.backends.ray_guardian import Guardian
from sweeps.errors import BackendError, StoreGone
from sweeps.slot_plan import cpu_threads_available
from sweeps.spec.model import StudySpec
from sweeps.stop_signals import STOP_SIGNALS, after_hangup

_GUARDIANS: list[Guardian] = []  # of the local Ray this process started (at most one)


def shutdown_ray() -> None:
    """Disconnect, and stop the local Ray this process started: every process of it has
    ended when this returns (sweeps.backends.ray_guardian)."""
    import ray

    try:
        ray.shutdown()
    finally:
        while _GUARDIANS:
            _GUARDIANS.pop().finish()


def init_ray(spec: StudySpec) -> bool:
    """Start Ray locally (this machine's CPUs and GPUs, no dashboard) or join
    ``resources.ray_address``. Returns whether this call connected (and must shut down)."""
    import ray

    if ray.is_initialized():
        return False  # the caller (a notebook, a test) owns the connection
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    env_vars = _worker_pythonpath(spec)
    if env_vars:
        kwargs["runtime_env"] = {"env_vars": env_vars}
    address = spec.resources.ray_address
    try:
        if address:
            ray.init(address=address, **kwargs)
            return True
        devices = spec.resources.devices
        num_gpus = 0 if devices == "cpu" else (len(devices) if isinstance(devices, list) else None)
        # Ray starts its workers at nice 15: beside any process at normal priority on the same
        # cores (an editor, a data job, other tests) the trials, the study's only work, got 3% of
        # a core under `taskset -c 0` with a busy loop. The raylet we start reads this at launch.
        os.environ.setdefault("RAY_worker_niceness", "0")
        guardian = Guardian().start()  # the local Ray we start ends with this driver, however it ends
        try:
            with _visible_devices(devices):
                ray.init(num_cpus=cpu_threads_available(), num_gpus=num_gpus, include_dashboard=False,
                         object_store_memory=256 * 2**20, **kwargs)
        except BaseException:
            guardian.finish()
            raise
        guardian.started_ray()
        _GUARDIANS.append(guardian)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        # Ray 2.60's token authentication (ray/_private/authentication): a head started with
        # RAY_AUTH_MODE=token refuses a driver that lacks its token.
        raise BackendError(f"cannot start or join {where}: {exc}. Check resources.ray_address "
                           "(auto, or host:port of a running head node: `ray start --head`) and, if the head "
                           "uses token authentication (RAY_AUTH_MODE=token), that this driver has its token: "
                           "RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH (default "
                           "~/.ray/auth_token)") from exc
    return True


class _RayNoiseFilter(logging.Filter):
    """Ray log records that would mislead a ``sweeps run`` user; the end-of-run summary says
    the same in sweeps' terms (what stopped, which trials failed, how to resume).

    - "Trials did not complete" / "Resume experiment with: Tuner.restore(...)": the summary
      lists failed and unfinished trials, and resuming is running the same command again;
    - after a driver crash, Ray's last experiment snapshot may still list a checkpoint it had
      already deleted (``CheckpointConfig(num_to_keep)``); deleting it again on restore fails
      with FileNotFoundError after the new checkpoint was registered. Harmless."""

    _HIDDEN = ("Trials did not complete", "Resume experiment with", "Experiment has been interrupted")

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FileNotFoundError) and "Error handling checkpoint" in text:
            return False
        return not any(h in text for h in self._HIDDEN)


def quiet_ray_noise() -> None:
    for name in ("ray.tune.execution.tune_controller", "ray.tune.tune"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RayNoiseFilter) for f in logger.filters):
            logger.addFilter(_RayNoiseFilter())


@contextlib.contextmanager
def _visible_devices(devices):
    """A device list limits the GPUs the local Ray instance sees (Ray then assigns them)."""
    if not isinstance(devices, list):
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _worker_pythonpath(spec: StudySpec) -> dict[str, str]:
    """A user task (``task.target``) must import in the trial actors as it does here: its
    package's folder goes onto their PYTHONPATH (Ray adds only the working directory)."""
    if not spec.task.target:
        return {}
    top = spec.task.target.partition(":")[0].split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None:
        return {}
    if found.submodule_search_locations:
        root = Path(list(found.submodule_search_locations)[0]).parent
    elif found.origin:
        root = Path(found.origin).parent
    else:
        return {}
    paths = [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class Interrupts:
    """SIGTERM, SIGINT, SIGHUP, ``budget.timeout`` and :meth:`stop` end the fit the resumable way:
    Ray's handler for SIGUSR1 (installed while ``fit`` runs) saves the experiment with the
    running trials, which resume on the next run. The signal is repeated until ``fit`` has
    seen it, since the handler is only there once the fit has started. SIGINT is taken here,
    not by Ray (``TUNE_DISABLE_SIGINT_HANDLER``), so that ``kill -INT`` of the driver alone
    and Ctrl-C of the whole terminal are both seen, and both exit 130."""

    def __init__(self, timeout_s: float | None, early: DriverSignals | None = None) -> None:
        self.timeout_s, self.signum, self.timed_out = timeout_s, None, False
        self._early = early
        self.stop_reason = ""  # why stop() was called (e.g. "max_failures")
        self.lost: StoreGone | None = None  # the MLflow store stayed away past its wait (store_gone)
        self._done = threading.Event()
        self._poking = threading.Event()
        self._old: dict = {}
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals need the main thread; a timeout is then not enforced
        self._old = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, lambda *_: None),
                     **{s: signal.signal(s, self._on_term) for s in STOP_SIGNALS}}
        if self.timeout_s:
            self._start(self._deadline)
        if self._early is not None and self._early.signum:  # arrived just before the fit began
            self._on_term(self._early.signum, None)
        return self

    def _on_term(self, signum, _frame) -> None:
        after_hangup(signum)
        self.signum = self.signum or signum  # the first signal names the stop
        self._start(self._poke)

    def stop(self, reason: str) -> None:
        """End the fit (from a Ray callback): ``reason`` says why, for the verdict."""
        self.stop_reason = self.stop_reason or reason
        self._start(self._poke)

    def store_gone(self, exc: StoreGone) -> None:
        """The MLflow store did not come back within its wait: the fit ends as on SIGTERM, and the
        driver exits with ``exc``."""
        self.lost = self.lost or exc
        self.stop("store gone")

    def _deadline(self) -> None:
        if not self._done.wait(self.timeout_s):
            self.timed_out = True
            self._poke()

    def _poke(self) -> None:
        if self._poking.is_set():
            return
        self._poking.set()
        while not self._done.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            self._done.wait(1.0)

    def _start(self, target) -> None:
        thread = threading.Thread(target=target, daemon=True, name="sweeps-interrupt")
        self._threads.append(thread)
        thread.start()

    def __exit__(self, *exc) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
