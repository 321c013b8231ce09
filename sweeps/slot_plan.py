"""Which devices and CPU threads each trial or worker gets (the spec's ``resources:``).

Backends run trials in persistent worker processes: :func:`plan_workers` gives each one a
:class:`WorkerSlot`; worker ``i`` keeps ``slots[i].devices`` for its whole life and is
started with ``slots[i].env()``.

Device ids are the ids ``CUDA_VISIBLE_DEVICES`` uses for a child process (physical ids
as this machine numbers them). Only the standard library is imported at module level;
torch is imported lazily, and only by :func:`discover_devices`, so planning stays cheap
and testable without a GPU.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from sweeps.errors import ResourcesError

# --------------------------------------------------------------------------- discovery


# A GPU driver shows one of these (NVIDIA; WSL's GPU bridge; ROCm, which torch.cuda also drives).
GPU_DRIVER_NODES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def visible_gpu_count() -> int:
    """Devices torch can see (after CUDA_VISIBLE_DEVICES), 0 without torch or CUDA."""
    if not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return 0  # no driver: torch would say 0 too, after seconds of importing it
    try:
        import torch  # lazy: importing torch costs seconds and most callers never need it
    except ImportError:
        return 0
    try:
        # device_count() does not create a CUDA context, so forking workers later is safe.
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - a broken driver means no usable CUDA, not a crash at planning time
        return 0


def _parse_visible(value: str) -> list[int]:
    """Parse CUDA_VISIBLE_DEVICES the way the CUDA runtime does for integer ids."""
    ids: list[int] = []
    for token in (t.strip() for t in value.split(",")):
        if not token:
            continue
        try:
            idx = int(token)
        except ValueError:
            raise ResourcesError(
                f"resources.devices: auto cannot map CUDA_VISIBLE_DEVICES={value!r} "
                f"(entry {token!r} is not an integer id; UUID and MIG ids are not supported). "
                "Fix: set CUDA_VISIBLE_DEVICES to integer ids, or list the ids in resources.devices."
            ) from None
        if idx < 0:  # the runtime ignores this entry and everything after it
            break
        ids.append(idx)
    return ids


def discover_devices(
    devices_setting: str | Sequence[int], *, environ: Mapping[str, str] | None = None
) -> list[int]:
    """Resolve ``resources.devices`` to the device ids trials may use. Called once per
    invocation, before the worker plan is built.

    ``"auto"``: every CUDA device visible to this process ([] without CUDA); ``"cpu"``: [];
    a list: that list, validated (ints >= 0, unique, and existing when CUDA is present).
    ``environ`` defaults to ``os.environ`` (tests pass their own).
    """
    env = os.environ if environ is None else environ
    if isinstance(devices_setting, str):
        if devices_setting == "cpu":
            return []
        if devices_setting != "auto":
            raise ResourcesError(
                f"resources.devices: {devices_setting!r} is not a valid setting. "
                "Fix: write auto, cpu, or a list of device ids such as [0, 1]."
            )
        return _visible_devices(env)

    if not isinstance(devices_setting, Sequence) or not devices_setting:
        raise ResourcesError(
            f"resources.devices: {devices_setting!r} is not a non-empty list of device ids. "
            "Fix: write auto, cpu, or a list such as [0, 1]."
        )
    # Not a str (returned above), though mypy's isinstance(Sequence) check widens it back; the
    # entries are checked below (a spec is user input).
    ids = list(cast(Sequence[int], devices_setting))
    bad = [d for d in ids if isinstance(d, bool) or not isinstance(d, int) or d < 0]
    if bad:
        raise ResourcesError(
            f"resources.devices: {ids!r} holds {bad!r}, which are not non-negative integer ids. "
            "Fix: list ids such as [0, 1]."
        )
    dupes = sorted({d for d in ids if ids.count(d) > 1})
    if dupes:
        raise ResourcesError(
            f"resources.devices: {ids!r} lists {dupes!r} more than once. Fix: list each id once."
        )
    # Without CUDA the list is kept as given, so plans can be made and tested on any machine.
    visible = _visible_devices(env)
    missing = [d for d in ids if d not in visible]
    if visible and missing:
        raise ResourcesError(
            f"resources.devices: {ids!r} names {missing!r}, which this process cannot see "
            f"(visible CUDA devices: {visible!r}). Fix: list only visible ids, or write auto."
        )
    return ids


def _visible_devices(env: Mapping[str, str]) -> list[int]:
    count = visible_gpu_count()
    if count == 0:
        return []
    if "CUDA_VISIBLE_DEVICES" in env:
        # The runtime drops ids that do not exist; count is what it kept, in this order.
        return _parse_visible(env["CUDA_VISIBLE_DEVICES"])[:count]
    return list(range(count))


# --------------------------------------------------------------------------- per-trial share


def _parse_gpus_per_trial(gpus_per_trial: float, n_devices: int) -> tuple[int, int]:
    """Return (devices per trial, trials per device): (K, 1) for whole K, (1, n) for 1/n.

    On a CPU-only machine (n_devices == 0) the form is still checked (0.3 is wrong on any
    machine) but not the count, so the spec default of 1 works there."""
    value = gpus_per_trial
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok_type and math.isfinite(value) and value >= 1 and float(value).is_integer():
        k = int(value)
        if n_devices and k > n_devices:
            raise ResourcesError(
                f"resources.gpus_per_trial: {value!r} is more than the {n_devices} device(s) "
                f"available. Fix: ask for at most {n_devices}, or list more resources.devices."
            )
        return k, 1
    if ok_type and math.isfinite(value) and 0 < value < 1:
        n = round(1 / value)
        if abs(1 / n - value) < 1e-9:
            return 1, n
    raise ResourcesError(
        f"resources.gpus_per_trial: {value!r} is neither a whole number >= 1 nor 1/n. "
        "Fix: use 1, 2, ... devices per trial, or 0.5, 0.25, ... to share one device."
    )


def _pick_devices(free: Sequence[int], k: int) -> tuple[int, ...] | None:
    """K free devices: the lowest run of consecutive ids (neighbours usually share the
    fastest links), else the K lowest free ids; None when fewer than K are free."""
    ordered = sorted(free)
    if len(ordered) < k:
        return None
    for start in range(len(ordered) - k + 1):
        window = ordered[start : start + k]
        if window[-1] - window[0] == k - 1:  # sorted and unique, so this means consecutive
            return tuple(window)
    return tuple(ordered[:k])


def ddp_processes(gpus_per_trial: float, devices_setting: object, train_device: str,
                  explicit_nproc: int | None, visible_gpus: int) -> int | None:
    """DDP processes for a trial whose spec leaves ``train.distributed.nproc`` unset: one per
    GPU of its worker's slot when it holds K >= 2 whole GPUs and sees them, else None (one process).
    Called in the trial's own process, after the backend set its CUDA_VISIBLE_DEVICES.

    An explicit ``nproc`` always wins (a user may want 1 process on 2 GPUs, e.g. for model
    code that places layers itself); a pinned ``train.device`` (cpu, cuda:1) means no DDP."""
    if explicit_nproc is not None or devices_setting == "cpu" or train_device not in ("auto", "cuda"):
        return None
    if not float(gpus_per_trial).is_integer() or gpus_per_trial < 2:
        return None
    k = int(gpus_per_trial)
    return k if visible_gpus >= k else None


# --------------------------------------------------------------------------- static workers


def cpu_threads_available() -> int:
    """CPU threads this process may run on: its affinity mask (taskset, cgroup cpusets)
    where the platform has one, else every core."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def threads_setting() -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks of this process (its first level: OpenMP reads
    "4,2" as 4 threads, then 2 in nested regions), or None where it is unset or not a count, as
    torch then ignores it too."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdecimal() and int(first) >= 1 else None


def auto_cpu_workers(cpu_threads: float) -> int:
    """``workers: auto`` on CPU, for both backends: one trial per thread (Ray Tune's default of
    one CPU per trial); on one machine ``plan_workers`` also keeps to what its memory holds.
    Independent trials side by side use the cores better than one trial's intra-op threads
    (benchmarks/RESULTS.md, parallel: 2 one-thread workers against one two-thread worker)."""
    return max(1, int(cpu_threads))


WORKER_MEMORY_BYTES = 1536 * 2**20  # a CPU worker: torch, MLflow and ONNX Runtime loaded, a small model training


def _workers_memory_holds() -> int:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 1 << 30
    return max(1, int(psutil.virtual_memory().available // WORKER_MEMORY_BYTES))


@dataclass(frozen=True)
class WorkerSlot:
    """What one persistent worker process owns for its whole life."""

    index: int
    devices: tuple[int, ...]
    threads: int

    def env(self) -> dict[str, str]:
        """Environment to start the worker with. OPENBLAS_* is left alone on purpose:
        the machine sets OPENBLAS_CORETYPE for correctness and we must not disturb it."""
        n = str(self.threads)
        # Only what libraries read at start-up, before the worker reads its go (worker_protocol).
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in self.devices),
            "OMP_NUM_THREADS": n,
            "MKL_NUM_THREADS": n,
        }


def plan_workers(
    device_ids: Sequence[int],
    gpus_per_trial: float,
    workers_setting: int | str,
    cpu_threads: int | None = None,
) -> list[WorkerSlot]:
    """Decide how many workers run trials in parallel and what each one owns. Called once
    per invocation, before the workers start.

    ``workers: auto`` runs as many trials as fit on the devices, or on CPU one worker per
    two threads (at least one). An explicit count is honoured; on GPU asking for more than
    fit is an error. Each worker gets ``cpu_threads // n`` threads (at least 1).
    """
    devices = list(device_ids)
    k, slots = _parse_gpus_per_trial(gpus_per_trial, len(devices))
    threads_total = cpu_threads_available() if cpu_threads is None else cpu_threads
    if isinstance(threads_total, bool) or not isinstance(threads_total, int) or threads_total < 1:
        raise ResourcesError(f"plan_workers: cpu_threads={threads_total!r} must be an int >= 1.")
    fits = len(devices) // k * slots  # 0 on CPU

    if workers_setting == "auto":
        n = fits if devices else min(auto_cpu_workers(threads_total), _workers_memory_holds())
    elif isinstance(workers_setting, int) and not isinstance(workers_setting, bool):
        n = workers_setting
        if n < 1:
            raise ResourcesError(
                f"resources.workers: {n} must be at least 1. Fix: write auto or a count >= 1."
            )
        if devices and n > fits:
            raise ResourcesError(
                f"resources.workers: {n} workers do not fit on devices {devices!r} with "
                f"gpus_per_trial {gpus_per_trial!r} (at most {fits} at once). "
                f"Fix: write workers: {fits} (or auto), lower gpus_per_trial, or add devices."
            )
    else:
        raise ResourcesError(
            f"resources.workers: {workers_setting!r} is not valid. Fix: write auto or a count >= 1."
        )

    # Dividing the threads keeps n workers from oversubscribing the cores (each torch
    # would otherwise start one thread per core); with more workers than threads the
    # floor of 1 is the least oversubscription possible.
    per_worker = max(1, threads_total // n)
    return [WorkerSlot(i, _worker_devices(devices, k, slots, i), per_worker) for i in range(n)]


def _worker_devices(devices: list[int], k: int, slots: int, i: int) -> tuple[int, ...]:
    """Static device group of worker ``i``."""
    if not devices:
        return ()
    if slots > 1:
        # Round-robin, not packing: a worker holds its device for good, so spreading
        # leaves no device idle when fewer workers than slots are asked for.
        return (sorted(devices)[i % len(devices)],)
    # Whole K: the i-th group taken in turn from the free devices by _pick_devices.
    free = sorted(devices)
    group: tuple[int, ...] = ()
    for _ in range(i + 1):
        group = _pick_devices(free, k) or ()
        free = [d for d in free if d not in group]
    return group
