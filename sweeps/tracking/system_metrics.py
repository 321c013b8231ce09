"""MLflow system metrics (CPU, memory, disk, network; NVIDIA GPUs through nvidia-ml-py) on a
trial's run, under MLflow's own names (``system/cpu_utilization_percentage``...), so the run's
"System metrics" tab shows them.

MLflow's ``SystemMetricsMonitor`` is not used as such: it writes through its own client (no
spool while the store is down), reads the run back after every sample to see whether it ended,
and logs "Started monitoring system metrics." at INFO for every run (``sweeps run --quiet`` must
print nothing from MLflow). Its monitors are: samples go through the trial's Tracker, buffered
and spooled like every other point.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from sweeps.tracking.base import RunHandle, Tracker

log = logging.getLogger(__name__)

PREFIX = "system/"  # MLflow's prefix: the UI's System metrics tab lists these keys
DEFAULT_INTERVAL_S = 2.0  # a 10 s trial gets about five points; a sample costs well under a millisecond
_gpu_state: dict[str, bool] = {}  # per process: whether NVML answered (asked once, not per trial)


def interval_s() -> float:
    """MLflow's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL when set, else DEFAULT_INTERVAL_S."""
    raw = os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL")
    try:
        return max(0.1, float(raw)) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


def enabled() -> bool:
    """On unless MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING says false (MLflow's own switch)."""
    return os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower() not in ("false", "0")


def _monitors() -> list[Any]:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    if _gpu_state.get("available", True):
        try:
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            monitors.append(GPUMonitor())
            _gpu_state["available"] = True
        except Exception:  # noqa: BLE001 - no NVIDIA GPU or no driver: CPU metrics only
            _gpu_state["available"] = False
    return monitors


class SystemMetrics:
    """Samples the machine every ``interval`` seconds into ``run`` from a daemon thread, from
    ``start()`` until ``stop()``, which logs a last sample so a trial shorter than the interval
    still gets one point. Never raises: a monitor that fails is reported once as a tag."""

    def __init__(self, tracker: Tracker, run: RunHandle, interval: float | None = None, first_step: int = 0) -> None:
        self.tracker, self.run = tracker, run
        self.interval = interval_s() if interval is None else interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitors: list[Any] = []
        self._step = first_step  # a continued run goes on after its earlier samples
        self._lock = threading.Lock()  # the thread's samples and stop()'s last one take turns

    def start(self) -> SystemMetrics:
        if not enabled():
            return self
        try:
            self._monitors = _monitors()
            self._collect()  # psutil's CPU percentage counts from its previous call: this is the baseline
            for monitor in self._monitors:
                monitor.clear_metrics()
        except Exception as exc:  # noqa: BLE001 - psutil missing or broken: say so on the run, train on
            self._failed(exc)
            return self
        self._thread = threading.Thread(target=self._loop, name=f"system-metrics-{self.run.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._sample():
                return

    def _collect(self) -> None:
        for monitor in self._monitors:
            monitor.collect_metrics()

    def _sample(self) -> bool:
        with self._lock:
            if not self._monitors:
                return False
            try:
                self._collect()
                values: dict[str, float] = {}
                for monitor in self._monitors:
                    values.update(monitor.aggregate_metrics())
                    monitor.clear_metrics()
                self.tracker.log_metrics(self.run, {PREFIX + k: float(v) for k, v in values.items()}, self._step)
                self._step += 1
                return True
            except Exception as exc:  # noqa: BLE001 - a sampling error must not reach the trial
                self._failed(exc)
                self._monitors = []  # said once; stop() samples nothing more
                return False

    def _failed(self, exc: BaseException) -> None:
        log.warning("system metrics of run %s stopped: %s: %s", self.run.run_id, type(exc).__name__, exc)
        try:
            self.tracker.log(self.run, tags={"sweeps.system_metrics_error": f"{type(exc).__name__}: {exc}"[:500]})
        except Exception:  # noqa: BLE001 - the tag is best effort too
            pass
