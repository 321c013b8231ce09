"""The peer benchmark's clock for the time to the first trial step (benchmarks/peers/step_clock):
the first optimizer step any process of an arm takes writes the time once; later steps, and
steps in other processes of the tree, leave it alone; without its variable it does nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.bench_peers import STEP_CLOCK, first_step_seconds, step_clock_env
from benchmarks.peers.step_clock.sitecustomize import ENV_FIRST_STEP

pytestmark = pytest.mark.slow  # each case imports torch in a fresh interpreter

# The first step is taken in a forked child (as a worker forked from sweeps' fork server), the
# parent steps after the child has exited; each prints the time just before and after its step.
ARM = textwrap.dedent("""
    import os, sys, time
    import torch

    def step(n):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(n):
            model(torch.ones(1, 2)).sum().backward()
            before = time.time()
            opt.step()
            print(before, time.time(), flush=True)

    pid = os.fork()
    if pid == 0:
        step(2)
        os._exit(0)
    os.waitpid(pid, 0)
    step(1)
""")


def _run(env: dict) -> list[tuple[float, float]]:
    out = subprocess.run([sys.executable, "-c", ARM], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    return [(float(a), float(b)) for a, b in (line.split() for line in out.splitlines())]


def test_the_first_step_of_any_process_of_the_arm_is_stamped_once(tmp_path):
    stamp = tmp_path / "first_step"
    steps = _run(step_clock_env(stamp))
    assert len(steps) == 3
    (when,) = (float(line) for line in stamp.read_text().splitlines())
    first_before, first_after = steps[0]  # the child's first step
    assert first_before <= when <= first_after
    assert first_step_seconds(stamp, first_before - 2.0) == pytest.approx(when - first_before + 2.0)


def test_without_its_variable_the_clock_stamps_nothing(tmp_path):
    env = step_clock_env(tmp_path / "first_step")
    del env[ENV_FIRST_STEP]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(STEP_CLOCK)
    assert len(_run(env)) == 3
    assert list(tmp_path.iterdir()) == []
    assert first_step_seconds(tmp_path / "first_step", 0.0) is None
