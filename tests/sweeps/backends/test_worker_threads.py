"""A worker sizes every thread pool its process has loaded to its slot at the go: a forked worker's
torch and numpy (OpenBLAS) were loaded by the fork server, before the slot's OMP_NUM_THREADS
could reach them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sweeps.study_helpers import sweeps_env

pytestmark = pytest.mark.slow  # a fresh interpreter imports torch and numpy

SCRIPT = """
import json
import numpy, torch  # loaded first, as the fork server loads them, with no thread count set
from threadpoolctl import threadpool_info
from sweeps.backends.optuna_worker import size_thread_pools
size_thread_pools(1)
print(json.dumps({"torch": torch.get_num_threads(),
                  "pools": {p["internal_api"]: p["num_threads"] for p in threadpool_info()}}))
"""


def test_a_worker_at_its_go_runs_every_loaded_pool_on_its_slots_threads():
    env = sweeps_env()
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["torch"] == 1
    assert seen["pools"] and set(seen["pools"].values()) == {1}, seen
