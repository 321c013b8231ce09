"""Ray 2.60 token authentication as docker-compose.yml and docs/SCALE_OUT.md set it up
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN in the environment of the head, of every node and of every
driver): a driver or node without the token cannot join the head; with it, a second node joins
and a `sweeps run` study runs its trials on both nodes: a PBT study, whose exploits move
checkpoints between trials and so between nodes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.scaleout.scaleout_helpers import stop_group, wait_for
from tests.sweeps.backends.conftest import kill_ray_processes, mlflow_client, study_runs, write_spec
from tests.sweeps.study_helpers import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]

EPOCHS = 4
TOKEN = "test-token-0123456789abcdef"
TOKEN_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
# A driver the head refuses retries for about 20 s (one try a second) before ray.init gives up;
# two tries refuse it the same way.
REFUSED_SOON = {"RAY_gcs_server_port_wait_time_s": "2"}
DRIVER = """
import ray
try:
    ray.init(address="127.0.0.1:{port}")
    print("JOINED", ray.get(ray.remote(lambda: 41).remote()) + 1)
except ConnectionError as exc:
    print("REFUSED", str(exc).splitlines()[0])
"""


def clean_env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"))}
    # HOME apart: Ray would also read (and `ray start` write) a token in ~/.ray/auth_token.
    return {**env, "HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _ray_start(home: Path, log: Path, temp_dir: str, *args: str, **env: str) -> subprocess.Popen:
    ray = Path(sys.executable).with_name("ray")
    with open(log, "w") as out:
        return subprocess.Popen([str(ray), "start", *args, "--num-gpus=0", "--disable-usage-stats",
                                 f"--temp-dir={temp_dir}", "--block"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=clean_env(home, **env))


def _wait_started(proc: subprocess.Popen, log: Path) -> None:
    wait_for(lambda: proc.poll() is not None or "Ray runtime started" in log.read_text(), timeout=300,
             every=0.5, what=lambda: f"a Ray node (log: {log.read_text()[-2000:]})")
    assert proc.poll() is None, log.read_text()[-2000:]


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """A Ray head in token mode with one CPU, no dashboard: (its port, a HOME folder, its temp dir)."""
    import socket

    home = tmp_path_factory.mktemp("ray-token")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ray's socket paths must fit 107 bytes: pytest's tmp_path is too deep for them.
    temp_dir = tempfile.mkdtemp(prefix="rtok", dir="/tmp")
    log = home / "head.log"
    head = _ray_start(home, log, temp_dir, "--head", f"--port={port}", "--num-cpus=1",
                      "--include-dashboard=false", **TOKEN_ENV)
    try:
        _wait_started(head, log)
        yield port, home, temp_dir
    finally:
        stop_group(head, grace=0)  # a graceful `ray stop` takes about 30 s and is not what is tested
        kill_ray_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_token_head_refuses_drivers_without_the_token(token_head):
    port, home, _ = token_head

    def drive(**env: str) -> str:
        out = subprocess.run([sys.executable, "-c", DRIVER.format(port=port)], capture_output=True, text=True,
                             timeout=300, env=clean_env(home, **env))
        return out.stdout + out.stderr

    refused = drive(**REFUSED_SOON)
    assert "REFUSED" in refused and "JOINED" not in refused, refused[-2000:]
    assert "JOINED 42" in drive(**TOKEN_ENV)
    wrong = drive(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-" + TOKEN, **REFUSED_SOON)
    assert "JOINED" not in wrong, wrong[-2000:]


def test_a_second_node_with_the_token_joins_and_a_pbt_study_runs_on_both(tmp_path, token_head):
    """The study joins the cluster by address and runs PBT: each trial keeps one MLflow run, and an
    exploited trial trains on at its new lr (the checkpoint it copied may come from the other node)."""
    port, home, _ = token_head
    address = f"127.0.0.1:{port}"

    def sweeps_run(folder: Path, **env: str) -> subprocess.CompletedProcess:
        spec = write_spec(folder, name="token", backend="ray", train={"epochs": EPOCHS},
                          search={"lr": {"type": "float", "low": 1.0e-4, "high": 0.5, "log": True},
                                  "momentum": {"type": "float", "low": 0.5, "high": 0.95}},
                          pruner={"name": "pbt", "perturbation_interval": 1},
                          budget={"n_trials": 4, "max_failures": 1},
                          resources={"devices": "cpu", "workers": 2, "cpus_per_trial": 1, "ray_address": address})
        return subprocess.run([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--quiet"], cwd=folder,
                              capture_output=True, text=True, timeout=900, env=clean_env(home, **env))

    # A driver without the token is stopped before any trial, pointed at the address and the token.
    refused = sweeps_run(tmp_path, **REFUSED_SOON)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode != 0 and "Traceback" not in said, said[-3000:]
    assert "resources.ray_address" in said and "RAY_AUTH_TOKEN" in said, said[-3000:]
    parents, trials = study_runs(tmp_path, "token")
    assert not trials and [p.info.status for p in parents] == ["FAILED"]  # not left RUNNING
    refused_parent = parents[0].info.run_id

    node_dir = tempfile.mkdtemp(prefix="rtn", dir="/tmp")
    log = tmp_path / "node.log"
    node = _ray_start(home, log, node_dir, f"--address={address}", "--num-cpus=1", **TOKEN_ENV)
    try:
        _wait_started(node, log)
        proc = sweeps_run(tmp_path, **TOKEN_ENV)
        out = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.returncode == 0, out
    finally:
        stop_group(node, grace=0)
        kill_ray_processes(node_dir)
        shutil.rmtree(node_dir, ignore_errors=True)
    parents, trials = study_runs(tmp_path, "token")
    # The study the refused driver opened, run again with the token: one study run, not two.
    assert [p.info.run_id for p in parents] == [refused_parent], [(p.info.run_id, p.info.status) for p in parents]
    assert parents[0].info.status == "FINISHED"
    runs = {int(r.data.tags["sweeps.trial_number"]): r for r in trials}
    assert sorted(runs) == [0, 1, 2, 3], out
    assert all(r.info.status == "FINISHED" and r.data.tags["sweeps.state"] == "COMPLETE" for r in trials), out
    nodes = {r.data.tags["sweeps.ray_node"].rsplit("/", 1)[-1] for r in trials}
    assert len(nodes) == 2, nodes  # trials on the head and on the node that joined with the token
    client = mlflow_client(tmp_path)
    for run in runs.values():
        if "sweeps.pbt_params" not in run.data.tags:
            continue  # never exploited another trial's checkpoint
        new_lr = json.loads(run.data.tags["sweeps.pbt_params"])["lr"]
        assert 1.0e-4 <= new_lr <= 0.5  # explore stays inside the search bounds
        history = sorted(client.get_metric_history(run.info.run_id, "lr"), key=lambda m: m.step)
        if history[-1].step < EPOCHS:
            # It exploited a trial that had already finished (trials 2 and 3 start once 0 and 1
            # are done): the donor's final checkpoint leaves no epoch to train at the new lr.
            donor = runs[int(run.data.tags["sweeps.pbt_from"])]
            assert max(m.step for m in client.get_metric_history(donor.info.run_id, "lr")) == EPOCHS
            continue
        lrs = [m.value for m in history]
        assert new_lr in [pytest.approx(x) for x in lrs]  # it trained at its new lr
