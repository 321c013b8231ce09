"""A local Ray started for a study runs its trials at normal priority, not at Ray's default nice 15
(beside a busy process on the same core, niced trials got 3% of it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.sweeps.study_helpers import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROBE = """
import os, ray
from sweeps.backends.ray_cluster import init_ray
from sweeps.spec.load import load_spec
assert init_ray(load_spec(os.environ["SPEC"]))

@ray.remote
def niceness():
    return os.nice(0)

print("niceness", ray.get(niceness.remote()))
ray.shutdown()
"""


def test_trials_of_a_local_ray_run_at_the_drivers_priority(tmp_path):
    spec = ROOT / "studies" / "digits_ray_asha.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(ROOT), SPEC=str(spec))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"niceness {os.nice(0)}"
