"""Unit tests for sweeps.pool: fake device id lists, no GPU needed."""
from __future__ import annotations

import math
import os
import random
import threading
import time

import pytest

from sweeps import pool as pool_mod
from sweeps.errors import SweepsError
from sweeps.pool import (
    DevicePool,
    Lease,
    ResourcesError,
    WorkerSlot,
    cpu_threads_available,
    discover_devices,
    plan_workers,
)


def held(pool: DevicePool) -> list[tuple[int, ...]]:
    return [lease.devices for lease in pool.leases()]


# --------------------------------------------------------------------------- whole devices


def test_one_gpu_per_trial_hands_each_device_once_then_none():
    pool = DevicePool([0, 1, 2, 3], 1)
    leases = [pool.acquire(f"t{i}") for i in range(4)]
    assert [lease.devices for lease in leases] == [(0,), (1,), (2,), (3,)]
    assert all(lease.share == 1.0 for lease in leases)
    assert pool.acquire("t4") is None
    assert pool.free_capacity() == 0
    assert len({lease.lease_id for lease in leases}) == 4


def test_two_gpus_per_trial_contiguous_pairs_and_reuse_after_release():
    pool = DevicePool([0, 1, 2, 3], 2)
    a, b = pool.acquire("a"), pool.acquire("b")
    assert (a.devices, b.devices) == ((0, 1), (2, 3))
    assert pool.acquire("c") is None
    pool.release(a)
    again = pool.acquire("c")
    assert again.devices == (0, 1)
    assert again.owner == "c" and again.lease_id != a.lease_id


def test_release_is_idempotent_and_ignores_none():
    pool = DevicePool([0, 1], 1)
    lease = pool.acquire("a")
    pool.release(lease)
    pool.release(lease)
    pool.release(None)
    assert pool.free_capacity() == 2
    # A stale lease must not free a device that a newer lease now holds.
    newer = pool.acquire("b")
    assert newer.devices == (0,)
    pool.release(lease)
    assert held(pool) == [(0,)]


def test_devices_return_when_the_trial_fails():
    pool = DevicePool([0, 1, 2, 3], 2)

    def trial() -> None:
        lease = pool.acquire("failing")
        try:
            assert pool.free_capacity() == 1
            raise RuntimeError("trial diverged")
        finally:
            pool.release(lease)

    with pytest.raises(RuntimeError, match="diverged"):
        trial()
    assert pool.free_capacity() == 2 and pool.leases() == []


def test_hold_context_manager_releases_on_prune():
    pool = DevicePool([0], 1)

    class Pruned(Exception):
        pass

    with pytest.raises(Pruned):
        with pool.hold("t") as lease:
            assert lease.devices == (0,)
            raise Pruned
    assert pool.free_capacity() == 1
    with pool.hold("t2"):
        with pytest.raises(TimeoutError, match="t3"):
            with pool.hold("t3", timeout=0.01):
                pass


def test_non_contiguous_fallback_prefers_a_contiguous_run():
    # Free 0, 2 and 3: the run (2, 3) wins over the lower but split (0, 2).
    pool = DevicePool([0, 2, 3], 2)
    assert pool.acquire("a").devices == (2, 3)
    assert pool.acquire("b") is None
    # No contiguous run at all: fall back to any K free devices.
    split = DevicePool([0, 2, 5], 2)
    assert split.acquire("a").devices == (0, 2)
    assert split.free_capacity() == 0


def test_pick_devices_policy():
    pick = pool_mod._pick_devices
    assert pick([3, 0, 2], 2) == (2, 3)
    assert pick([0, 1, 2, 3], 2) == (0, 1)
    assert pick([0, 2, 4], 2) == (0, 2)
    assert pick([1, 3, 4, 5, 7], 3) == (3, 4, 5)
    assert pick([1], 2) is None


def test_fragmentation_whole_devices():
    pool = DevicePool(list(range(6)), 2)
    a, b, c = (pool.acquire(x) for x in "abc")
    assert [a.devices, b.devices, c.devices] == [(0, 1), (2, 3), (4, 5)]
    pool.release(a)
    pool.release(c)
    assert pool.free_capacity() == 2
    assert pool.acquire("d").devices == (0, 1)  # lowest run first
    assert pool.acquire("e").devices == (4, 5)


def test_fragmentation_with_gaps_in_the_ids_uses_the_fallback():
    pool = DevicePool([0, 1, 3, 4, 5, 7], 2)
    a, b, c = (pool.acquire(x) for x in "abc")
    assert [a.devices, b.devices, c.devices] == [(0, 1), (3, 4), (5, 7)]  # no run left for c
    pool.release(b)
    assert pool.acquire("d").devices == (3, 4)  # the freed run comes back whole
    pool.release(a)
    pool.release(c)
    assert [pool.acquire(x).devices for x in "ef"] == [(0, 1), (5, 7)]

# --------------------------------------------------------------------------- fractional


def test_half_gpu_packs_two_trials_per_device():
    pool = DevicePool([0, 1], 0.5)
    assert pool.capacity == 4
    leases = [pool.acquire(f"t{i}") for i in range(4)]
    assert [lease.devices for lease in leases] == [(0,), (0,), (1,), (1,)]
    assert all(lease.share == 0.5 for lease in leases)
    assert pool.acquire("t4") is None
    assert leases[0].env() == {"CUDA_VISIBLE_DEVICES": "0"}


def test_fractional_fills_a_partly_used_device_before_opening_a_new_one():
    pool = DevicePool([0, 1, 2], 0.5)
    a, b, c = (pool.acquire(x) for x in "abc")
    assert [a.devices, b.devices, c.devices] == [(0,), (0,), (1,)]
    pool.release(a)  # devices 0 and 1 are both half used, 2 is empty
    assert pool.free_capacity() == 4
    assert pool.acquire("d").devices == (0,)
    assert pool.acquire("e").devices == (1,)
    assert pool.acquire("f").devices == (2,)  # only now a fresh device opens


def test_quarter_gpu():
    pool = DevicePool([3], 0.25)
    leases = [pool.acquire(str(i)) for i in range(4)]
    assert all(lease.devices == (3,) and lease.share == 0.25 for lease in leases)
    assert pool.acquire("x") is None


# --------------------------------------------------------------------------- cpu pool, env


def test_cpu_pool_always_gives_an_empty_lease():
    pool = DevicePool([], 1)
    leases = [pool.acquire(str(i)) for i in range(10)]
    assert all(lease.devices == () and lease.share == 0.0 for lease in leases)
    assert leases[0].env() == {"CUDA_VISIBLE_DEVICES": ""}
    assert pool.capacity == math.inf and pool.free_capacity() == math.inf


def test_lease_env_and_frozen():
    lease = DevicePool([2, 3], 2).acquire("t")
    assert lease.env() == {"CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(AttributeError):
        lease.devices = (0,)
    assert isinstance(lease, Lease)


# --------------------------------------------------------------------------- threads


def test_many_threads_never_exceed_capacity():
    pool = DevicePool([0, 1, 2, 3], 0.5)
    in_use: dict[int, int] = {}
    peak = [0]
    errors: list[str] = []
    guard = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(100):
            lease = pool.acquire_blocking(f"w{seed}", timeout=5)
            if lease is None:
                errors.append("timed out")
                return
            try:
                with guard:
                    for d in lease.devices:
                        in_use[d] = in_use.get(d, 0) + 1
                        if in_use[d] > 2:
                            errors.append(f"device {d} over-shared")
                    peak[0] = max(peak[0], sum(in_use.values()))
                if rng.random() < 0.2:
                    time.sleep(0)  # let another thread in while the lease is held
            finally:
                with guard:
                    for d in lease.devices:
                        in_use[d] -= 1
                pool.release(lease)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert 1 <= peak[0] <= pool.capacity == 8
    assert pool.leases() == [] and pool.free_capacity() == 8


def test_acquire_blocking_wakes_on_release_and_times_out():
    pool = DevicePool([0], 1)
    first = pool.acquire("a")
    assert pool.acquire_blocking("b", timeout=0.01) is None
    got: list[Lease | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire_blocking("b", timeout=5)))
    waiter.start()
    time.sleep(0.05)
    pool.release(first)
    waiter.join(timeout=5)
    assert got and got[0] is not None and got[0].owner == "b"


# --------------------------------------------------------------------------- invalid settings


@pytest.mark.parametrize("k", [0, -1, 0.3, 1.5, 0.0, float("nan"), True, "1"])
def test_invalid_gpus_per_trial(k):
    with pytest.raises(ValueError, match="gpus_per_trial"):
        DevicePool([0, 1, 2, 3], k)


def test_more_gpus_per_trial_than_devices():
    with pytest.raises(ResourcesError, match=r"gpus_per_trial: 5 .*4 device"):
        DevicePool([0, 1, 2, 3], 5)
    # On CPU the default of 1 (or any whole K) is fine; the form is still checked.
    DevicePool([], 4)
    with pytest.raises(ResourcesError):
        DevicePool([], 0.3)


def test_resources_error_is_in_both_hierarchies():
    with pytest.raises(SweepsError) as info:
        DevicePool([0], 0.3)
    assert isinstance(info.value, ValueError) and info.value.exit_code == 2
    assert "Fix:" in str(info.value)


def test_duplicate_pool_ids():
    with pytest.raises(ResourcesError, match="repeat"):
        DevicePool([0, 0], 1)


# --------------------------------------------------------------------------- discover_devices


def test_discover_cpu_and_lists_without_cuda(monkeypatch):
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 0)
    assert discover_devices("cpu") == []
    assert discover_devices("auto", environ={"CUDA_VISIBLE_DEVICES": "0,1"}) == []
    assert discover_devices([3, 1]) == [3, 1]  # kept as given without CUDA


@pytest.mark.parametrize(
    "bad, match",
    [([0, 0], "more than once"), ([-1], "non-negative"), ([0, "1"], "non-negative"),
     ([True], "non-negative"), ([], "non-empty"), ("gpu", "not a valid"), (2, "non-empty")],
)
def test_discover_rejects_bad_lists(monkeypatch, bad, match):
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match=match) as info:
        discover_devices(bad)
    assert "resources.devices" in str(info.value) and "Fix:" in str(info.value)


def test_discover_with_fake_cuda(monkeypatch):
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 4)
    assert discover_devices("auto", environ={}) == [0, 1, 2, 3]
    assert discover_devices([1, 3], environ={}) == [1, 3]
    with pytest.raises(ResourcesError, match=r"\[4\].*visible CUDA devices: \[0, 1, 2, 3\]"):
        discover_devices([0, 4], environ={})


def test_discover_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 2)
    env = {"CUDA_VISIBLE_DEVICES": "2, 3"}
    assert discover_devices("auto", environ=env) == [2, 3]
    assert discover_devices([3], environ=env) == [3]
    with pytest.raises(ResourcesError, match="cannot see"):
        discover_devices([0], environ=env)
    # Entries after a negative id are ignored by the runtime, and so here.
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 1)
    assert discover_devices("auto", environ={"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == [1]
    with pytest.raises(ResourcesError, match="UUID"):
        discover_devices("auto", environ={"CUDA_VISIBLE_DEVICES": "GPU-1234"})


def test_pool_module_does_not_import_torch_at_module_level():
    source = open(pool_mod.__file__, encoding="utf-8").read()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top_level if "torch" in line]


# --------------------------------------------------------------------------- workers


def test_cpu_threads_available_matches_affinity():
    n = cpu_threads_available()
    assert n >= 1
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("cores, workers, threads", [(2, 1, 2), (8, 4, 2), (1, 1, 1), (3, 1, 3)])
def test_plan_workers_cpu_auto(cores, workers, threads):
    slots = plan_workers([], 1, "auto", cores)
    assert len(slots) == workers
    assert all(s.devices == () and s.threads == threads for s in slots)
    assert sum(s.threads for s in slots) <= cores


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


@pytest.mark.parametrize("devices, workers, threads, writer", [
    ([], 1, 2, False),  # one worker's two threads train on both cores: writing inline is cheaper
    ([], 2, 2, False),
    ([], 1, 4, False),
    ([], 2, 5, True),  # 2 x 2 threads train, a core is left over
    ([0], 1, 2, True),  # on a GPU the trainer's CPU mostly feeds the device
    ([0, 1], 2, 2, True),
])
def test_trainers_write_from_a_process_when_a_core_is_left_for_it(devices, workers, threads, writer, monkeypatch):
    monkeypatch.delenv("SWEEPS_TRACKING_WRITER", raising=False)
    slots = plan_workers(devices, 1, workers, threads)
    assert {s.writer_process for s in slots} == {writer}
    monkeypatch.setenv("SWEEPS_TRACKING_WRITER", "inline" if writer else "process")  # the user's choice wins
    assert {s.writer_process for s in plan_workers(devices, 1, workers, threads)} == {not writer}


def test_a_worker_started_by_hand_follows_the_users_choice_else_decides_alone(monkeypatch):
    monkeypatch.setenv("SWEEPS_TRACKING_WRITER", "process")
    assert pool_mod.worker_writes_from_a_process()
    monkeypatch.setenv("SWEEPS_TRACKING_WRITER", "inline")
    assert not pool_mod.worker_writes_from_a_process()
    monkeypatch.delenv("SWEEPS_TRACKING_WRITER")  # `sweeps worker` by hand, all threads, no GPU
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 0)
    assert not pool_mod.worker_writes_from_a_process()
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 1)
    assert pool_mod.worker_writes_from_a_process()


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
    assert pool_mod.ddp_processes(gpus_per_trial, devices, device, explicit, visible) == expected
