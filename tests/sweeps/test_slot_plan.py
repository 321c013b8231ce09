"""Unit tests for sweeps.slot_plan: fake device id lists, no GPU needed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sweeps import slot_plan
from sweeps.backends import optuna_backend
from sweeps.backends.optuna_backend import plan_local_workers
from sweeps.errors import SweepsError
from sweeps.slot_plan import (
    ResourcesError,
    WorkerSlot,
    cpu_threads_available,
    discover_devices,
    plan_workers,
)
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import tiny_spec

# --------------------------------------------------------------------------- device groups


def test_pick_devices_policy():
    pick = slot_plan._pick_devices
    assert pick([3, 0, 2], 2) == (2, 3)
    assert pick([0, 1, 2, 3], 2) == (0, 1)
    assert pick([0, 2, 4], 2) == (0, 2)
    assert pick([1, 3, 4, 5, 7], 3) == (3, 4, 5)
    assert pick([1], 2) is None


def test_whole_device_groups_prefer_contiguous_runs_and_fall_back_over_gaps():
    # Worker i gets the i-th group _pick_devices takes from what the earlier workers left.
    assert [s.devices for s in plan_workers(list(range(6)), 2, "auto", 6)] == [(0, 1), (2, 3), (4, 5)]
    assert [s.devices for s in plan_workers([0, 1, 3, 4, 5, 7], 2, "auto", 6)] == [(0, 1), (3, 4), (5, 7)]
    assert [s.devices for s in plan_workers([0, 2, 5], 2, "auto", 6)] == [(0, 2)]  # no run at all


# --------------------------------------------------------------------------- invalid settings


@pytest.mark.parametrize("k", [0, -1, 0.3, 1.5, 0.0, float("nan"), True, "1"])
def test_invalid_gpus_per_trial(k):
    with pytest.raises(ValueError, match="gpus_per_trial"):
        plan_workers([0, 1, 2, 3], k, "auto", 8)


def test_more_gpus_per_trial_than_devices():
    with pytest.raises(ResourcesError, match=r"gpus_per_trial: 5 .*4 device"):
        plan_workers([0, 1, 2, 3], 5, "auto", 8)
    # On CPU the default of 1 (or any whole K) is fine; the form is still checked.
    plan_workers([], 4, "auto", 8)
    with pytest.raises(ResourcesError):
        plan_workers([], 0.3, "auto", 8)


def test_resources_error_is_in_both_hierarchies():
    with pytest.raises(SweepsError) as info:
        plan_workers([0], 0.3, "auto", 8)
    assert isinstance(info.value, ValueError) and info.value.exit_code == 2
    assert "Fix:" in str(info.value)


# --------------------------------------------------------------------------- discover_devices


def test_discover_cpu_and_lists_without_cuda(monkeypatch):
    monkeypatch.setattr(slot_plan, "visible_gpu_count", lambda: 0)
    assert discover_devices("cpu") == []
    assert discover_devices("auto", environ={"CUDA_VISIBLE_DEVICES": "0,1"}) == []
    assert discover_devices([3, 1]) == [3, 1]  # kept as given without CUDA


@pytest.mark.parametrize(
    "bad, match",
    [([0, 0], "more than once"), ([-1], "non-negative"), ([0, "1"], "non-negative"),
     ([True], "non-negative"), ([], "non-empty"), ("gpu", "not a valid"), (2, "non-empty")],
)
def test_discover_rejects_bad_lists(monkeypatch, bad, match):
    monkeypatch.setattr(slot_plan, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match=match) as info:
        discover_devices(bad)
    assert "resources.devices" in str(info.value) and "Fix:" in str(info.value)


def test_discover_with_fake_cuda(monkeypatch):
    monkeypatch.setattr(slot_plan, "visible_gpu_count", lambda: 4)
    assert discover_devices("auto", environ={}) == [0, 1, 2, 3]
    assert discover_devices([1, 3], environ={}) == [1, 3]
    with pytest.raises(ResourcesError, match=r"\[4\].*visible CUDA devices: \[0, 1, 2, 3\]"):
        discover_devices([0, 4], environ={})


def test_discover_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(slot_plan, "visible_gpu_count", lambda: 2)
    env = {"CUDA_VISIBLE_DEVICES": "2, 3"}
    assert discover_devices("auto", environ=env) == [2, 3]
    assert discover_devices([3], environ=env) == [3]
    with pytest.raises(ResourcesError, match="cannot see"):
        discover_devices([0], environ=env)
    # Entries after a negative id are ignored by the runtime, and so here.
    monkeypatch.setattr(slot_plan, "visible_gpu_count", lambda: 1)
    assert discover_devices("auto", environ={"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == [1]
    with pytest.raises(ResourcesError, match="UUID"):
        discover_devices("auto", environ={"CUDA_VISIBLE_DEVICES": "GPU-1234"})


def test_importing_the_pool_does_not_import_torch():
    # Planning runs in the CLI process before any worker starts: importing torch there costs
    # seconds, so only discover_devices may import it, and only when called.
    code = "import sys, sweeps.slot_plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- workers


def test_cpu_threads_available_matches_affinity():
    n = cpu_threads_available()
    assert n >= 1
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("cores, workers, threads", [(2, 2, 1), (8, 8, 1), (1, 1, 1), (3, 3, 1)])
def test_plan_workers_cpu_auto(cores, workers, threads, monkeypatch):
    monkeypatch.setattr(slot_plan, "_workers_memory_holds", lambda: 64)  # memory is not the limit here
    slots = plan_workers([], 1, "auto", cores)
    assert len(slots) == workers
    assert all(s.devices == () and s.threads == threads for s in slots)
    assert sum(s.threads for s in slots) <= cores


def test_plan_workers_cpu_auto_runs_no_more_workers_than_memory_holds(monkeypatch):
    monkeypatch.setattr(slot_plan, "_workers_memory_holds", lambda: 3)
    slots = plan_workers([], 1, "auto", 8)
    assert [s.threads for s in slots] == [2, 2, 2]  # the threads are shared among the 3 that fit


def test_memory_holds_at_least_one_worker_and_counts_what_is_available(monkeypatch):
    import psutil

    class Memory:
        available = 5 * slot_plan.WORKER_MEMORY_BYTES + 1

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    assert slot_plan._workers_memory_holds() == 5
    Memory.available = 10
    assert slot_plan._workers_memory_holds() == 1


def test_plan_workers_cpu_explicit():
    slots = plan_workers([], 1, 3, 8)
    assert [s.index for s in slots] == [0, 1, 2]
    assert [s.threads for s in slots] == [2, 2, 2]
    # More workers than threads: honoured, each still gets one thread.
    assert [s.threads for s in plan_workers([], 1, 4, 2)] == [1, 1, 1, 1]


def test_plan_workers_gpu_auto_whole_and_fractional():
    slots = plan_workers([0, 1, 2, 3], 2, "auto", 16)
    assert [s.devices for s in slots] == [(0, 1), (2, 3)]
    assert [s.threads for s in slots] == [8, 8]
    slots = plan_workers([0, 1, 2, 3], 1, "auto", 8)
    assert [s.devices for s in slots] == [(0,), (1,), (2,), (3,)]
    slots = plan_workers([0, 1], 0.5, "auto", 8)
    assert [s.devices for s in slots] == [(0,), (1,), (0,), (1,)]  # share, spread evenly
    assert sum(s.threads for s in slots) <= 8


def test_plan_workers_gpu_explicit_and_capped():
    assert [s.devices for s in plan_workers([0, 1], 0.5, 2, 4)] == [(0,), (1,)]
    assert [s.devices for s in plan_workers([0, 2, 3], 2, 1, 4)] == [(2, 3)]
    with pytest.raises(ResourcesError, match=r"workers: 3 .*at most 2.*workers: 2"):
        plan_workers([0, 1, 2, 3], 2, 3, 8)


@pytest.mark.parametrize("setting", [0, -2, "many", 1.5, True, None])
def test_plan_workers_invalid_setting(setting):
    with pytest.raises(ValueError, match="resources.workers"):
        plan_workers([], 1, setting, 4)


def test_plan_workers_invalid_share_and_threads():
    with pytest.raises(ResourcesError, match="gpus_per_trial"):
        plan_workers([0, 1], 0.3, "auto", 4)
    with pytest.raises(ResourcesError, match="cpu_threads"):
        plan_workers([], 1, "auto", 0)


def test_worker_env_leaves_openblas_alone():
    slot = WorkerSlot(index=0, devices=(2, 3), threads=4)
    env = slot.env()
    assert env == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
    }  # what else a worker needs is in its typed go message (worker_protocol), not the environment
    assert not any(key.startswith("OPENBLAS") for key in env)
    assert plan_workers([], 1, 1, 2)[0].env()["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("value, threads", [("3", 3), (" 2 ", 2), ("4,2", 4), ("", None), ("0", None),
                                            ("-1", None), ("many", None)])
def test_omp_num_threads_is_read_as_openmp_reads_it(value, threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert slot_plan.threads_setting() == threads


@pytest.mark.parametrize("value, workers, threads", [("1", 1, [1]), (None, 1, [8]), ("16", 1, [8]),
                                                     ("1", 2, [1, 1]), ("2", 2, [2, 2]), ("4", 2, [4, 4])])
def test_sweeps_run_gives_a_worker_no_more_threads_than_omp_num_threads(value, workers, threads, monkeypatch,
                                                                         caplog):
    """A user's OMP_NUM_THREADS caps each worker's threads, never their number, as it caps torch in
    a plain script: one worker on eight cores trains on eight threads unless it says fewer (a shared
    machine, or two test processes sharing the cores, whose trials would otherwise run twice the
    threads there are cores)."""
    monkeypatch.setattr(optuna_backend, "cpu_threads_available", lambda: 8)
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    spec = spec_from_dict(tiny_spec("threads", resources={"workers": workers}))
    with caplog.at_level("INFO", logger="sweeps"):
        slots = plan_local_workers(spec)
    assert [s.threads for s in slots] == threads and slots[0].env()["OMP_NUM_THREADS"] == str(threads[0])
    # A cap below the share is said (an OMP_NUM_THREADS=1 exported for other jobs slows every trial).
    said = f"OMP_NUM_THREADS={value}: each worker trains on {threads[0]} CPU thread(s), not its share of"
    assert (said in caplog.text) == (threads[0] < 8 // workers), caplog.text


def test_plan_workers_default_threads_from_machine():
    slots = plan_workers([], 1, "auto")
    assert sum(s.threads for s in slots) <= max(cpu_threads_available(), len(slots))


# --------------------------------------------------------------------------- DDP over a lease


@pytest.mark.parametrize(
    "gpus_per_trial, devices, device, explicit, visible, expected",
    [
        (2, "auto", "auto", None, 2, 2),      # a 2-GPU lease runs 2 ranks
        (4, [0, 1, 2, 3], "cuda", None, 4, 4),
        (4, "auto", "auto", None, 8, 4),      # more visible than leased: one rank per leased GPU
        (1, "auto", "auto", None, 4, None),   # one GPU: a plain process
        (0.5, "auto", "auto", None, 1, None),  # a GPU share: a plain process
        (2, "auto", "auto", None, 0, None),   # CPU-only machine: the pool ran it on CPU
        (2, "auto", "auto", None, 1, None),   # fewer visible than K: no DDP over GPUs it lacks
        (2, "cpu", "auto", None, 2, None),    # devices: cpu
        (2, "auto", "cpu", None, 2, None),    # train.device pinned to CPU
        (2, "auto", "cuda:1", None, 2, None),  # pinned to one GPU
        (2, "auto", "auto", 1, 2, None),      # an explicit nproc wins
        (2, "auto", "auto", 2, 2, None),
    ],
)
def test_ddp_processes_one_rank_per_leased_gpu(gpus_per_trial, devices, device, explicit, visible, expected):
    assert slot_plan.ddp_processes(gpus_per_trial, devices, device, explicit, visible) == expected


@pytest.mark.parametrize("n_trials, workers, started", [(2, 8, 2), (8, 3, 3)])
def test_sweeps_run_starts_no_more_workers_than_the_study_has_trials(n_trials, workers, started):
    """The plan ``sweeps run`` starts its workers from (OptunaBackend.run: one worker per slot,
    recorded in the study run's ``sweeps.workers`` tag): a worker with no trial would only cost
    memory."""
    spec = spec_from_dict(tiny_spec("cap", budget={"n_trials": n_trials}, resources={"workers": workers}))
    slots = plan_local_workers(spec)
    assert [s.index for s in slots] == list(range(started))
