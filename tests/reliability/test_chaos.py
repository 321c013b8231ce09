"""Chaos: a study of 24 tiny trials with 3 workers on PostgreSQL storage and an ``mlflow server``,
hit by 6 faults in a random order: each of SIGKILL of a worker, the MLflow server killed for 4-20 s,
PostgreSQL restarted, SIGHUP and SIGTERM to the driver followed by the same command, and one more
drawn from them. At the end:
exactly ``n_trials`` finished, every finished trial's run FINISHED with each of its points once,
its logged model and its dataset inputs, nothing RUNNING, nothing left to sync, no process left.

The draw is seeded and the seed printed (``SWEEPS_CHAOS_SEED=<seed>`` replays a draw). Each fault
fires at a known moment, after the k-th trial has finished in the study's storage (k = 3, 6, ...,
18; after a driver stop, not before the same command has finished a trial), never on a timer;
how long a server stays down is drawn too, and nothing is timed against it.
While a server is down the trials already training train on into the outage and end in it, and
new trials wait at their start (``SWEEPS_HOLD_TRIAL``) until it is back: tiny trials would
otherwise finish the whole study inside one outage, and the later faults would hit nothing.
Run it with: ``pytest -n 0 tests/reliability/test_chaos.py``.
"""
from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState
from sqlalchemy.pool import NullPool

from tests.scaleout.scaleout_helpers import start_mlflow_server, stop_group
from tests.sweeps.backends.conftest import _pids_using
from tests.sweeps.study_helpers import sweeps_env, write_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(3000)]

N_TRIALS, WORKERS, EPOCHS, FAULTS, EVERY = 24, 3, 2, 6, 3
KINDS = ("worker_kill", "mlflow_down", "postgres_restart", "driver_sighup", "driver_sigterm")
NAME = "chaos"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(seed: int) -> list[tuple[int, str, int]]:
    """(after how many finished trials, which fault, seconds down) for each fault. Every kind comes
    at least once: six faults drawn independently would miss one kind or more in 88% of runs."""
    rng = random.Random(seed)
    kinds = [*KINDS, *(rng.choice(KINDS) for _ in range(FAULTS - len(KINDS)))]
    rng.shuffle(kinds)
    return [(EVERY * (i + 1), kind, rng.randint(4, 20)) for i, kind in enumerate(kinds)]


class Chaos:
    """The processes of the study under test and the faults done to them."""

    def __init__(self, tmp_path: Path, pg, seed: int) -> None:
        self.tmp, self.pg, self.rng = tmp_path, pg, random.Random(seed + 1)
        self.port = _free_port()
        self.server, self.base, _, _ = start_mlflow_server(tmp_path, f"sqlite:///{tmp_path / 'server.db'}", self.port)
        self.spec = write_spec(
            tmp_path, name=NAME, storage=pg.url, tracking={"uri": self.base},
            task={"name": "synthetic", "model": "mlp", "args": {"shape": [1, 8, 8], "num_classes": 4,
                                                                 "n_train": 256, "n_val": 64, "width": 16}},
            train={"epochs": EPOCHS, "batch_size": 64}, pruner={"name": "none"},
            budget={"n_trials": N_TRIALS, "max_failures": 20}, resources={"devices": "cpu", "workers": WORKERS})
        self.log = tmp_path / "driver.log"
        self.gate = tmp_path / "trials-may-start"
        self.gate.touch()
        self.env = sweeps_env(OMP_NUM_THREADS="1", SWEEPS_TRACKING_RETRY_S="1", SWEEPS_HOLD_TRIAL=str(self.gate))
        self.driver: subprocess.Popen | None = None
        self.storage: optuna.storages.RDBStorage | None = None
        self.exits: list[int] = []

    # ---- the driver ------------------------------------------------------------------------------
    def start_driver(self) -> None:
        with open(self.log, "a") as out:
            out.write(f"\n==== sweeps run {self.spec.name} ====\n")
            out.flush()
            self.driver = subprocess.Popen([sys.executable, "-m", "sweeps.cli", "run", str(self.spec), "--quiet"],
                                           cwd=self.tmp, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_driver(self, timeout: float = 1200) -> int:
        assert self.driver is not None
        code = self.driver.wait(timeout=timeout)
        self.exits.append(code)
        return code

    # ---- the study, read from its storage ---------------------------------------------------------
    def finished(self) -> int | None:
        """Trials finished (COMPLETE or PRUNED); None while the storage does not answer."""
        try:
            if self.storage is None:
                self.storage = optuna.storages.RDBStorage(self.pg.url, engine_kwargs={"poolclass": NullPool},
                                                          skip_table_creation=True)
            study = optuna.load_study(study_name=NAME, storage=self.storage)
            return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        except Exception:  # noqa: BLE001 - not created yet, or the server is restarting
            return None

    def until_finished(self, k: int) -> None:
        while (self.finished() or 0) < k:
            assert self.driver is not None and self.driver.poll() is None, \
                f"sweeps run exited with {self.driver and self.driver.returncode}:\n{self.text()}"
            time.sleep(0.5)

    # ---- faults --------------------------------------------------------------------------------
    def workers(self) -> list[int]:
        """The driver's live workers: forked from its fork server, and named so (``ps -o comm``)."""
        assert self.driver is not None
        pids = []
        for p in psutil.Process(self.driver.pid).children(recursive=True):
            try:
                if p.name().startswith("sweeps-worker") and p.status() != psutil.STATUS_ZOMBIE:
                    pids.append(p.pid)
            except psutil.Error:
                continue  # it ended meanwhile
        return sorted(pids)

    def do(self, kind: str, down_s: int) -> None:
        if kind == "worker_kill":
            while not (pids := self.workers()):
                assert self.driver is not None and self.driver.poll() is None, f"the driver ended:\n{self.text()}"
                time.sleep(0.2)  # a fresh worker is on its way
            os.kill(self.rng.choice(pids), signal.SIGKILL)
        elif kind == "mlflow_down":
            self.gate.unlink()
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(timeout=60)
            time.sleep(down_s)
            self.server, _, _, _ = start_mlflow_server(self.tmp, f"sqlite:///{self.tmp / 'server.db'}", self.port)
            self.gate.touch()
        elif kind == "postgres_restart":
            self.gate.unlink()
            self.pg.stop()
            time.sleep(down_s / 2)
            self.pg.start()
            self.gate.touch()
        else:
            assert self.driver is not None
            signum = signal.SIGHUP if kind == "driver_sighup" else signal.SIGTERM
            self.driver.send_signal(signum)
            code = self.wait_driver()
            assert code == 128 + signum, f"{kind}: exit {code}\n{self.text()}"
            self.start_driver()
            # The next fault hits the study, not the same command's start: a store that does not
            # answer when `sweeps run` first opens it is an error at once (a wrong host or port
            # says so before anything runs), and the trials that ended while the stopped driver
            # shut down may already have passed the next fault's k.
            self.until_finished((self.finished() or 0) + 1)

    def close(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            os.killpg(self.driver.pid, signal.SIGKILL)
            self.driver.wait(timeout=60)
        stop_group(self.server)


def _left_behind(folder: Path) -> list[int]:
    """Live processes of the study working in its folder: a driver or one of its workers."""
    return [pid for marker in ("sweeps.cli", "sweeps.backends.optuna_worker", "sweeps.backends.worker_forkserver")
            for pid in _pids_using(marker)
            if os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(folder)]


def test_a_study_comes_through_random_faults_with_every_record_once(tmp_path, own_postgres):
    seed = int(os.environ.get("SWEEPS_CHAOS_SEED") or secrets.randbelow(2**31))
    plan = _plan(seed)
    print(f"chaos seed {seed} (replay with SWEEPS_CHAOS_SEED={seed}); faults: {plan}", flush=True)
    chaos = Chaos(tmp_path, own_postgres, seed)
    try:
        chaos.start_driver()
        for after, kind, down_s in plan:
            chaos.until_finished(after)
            print(f"after {after} finished trials: {kind}" + (f" ({down_s} s)" if "down" in kind else ""), flush=True)
            chaos.do(kind, down_s)
        code = chaos.wait_driver()
        assert code == 0, f"exit {code}\n{chaos.text()}"
        leftovers = _left_behind(tmp_path)
        _check_records(chaos, own_postgres.url)
        assert leftovers == [], leftovers
    finally:
        chaos.close()


def _check_records(chaos: Chaos, storage_url: str) -> None:
    from mlflow.tracking import MlflowClient

    study = optuna.load_study(study_name=NAME, storage=storage_url)
    trials = study.get_trials(deepcopy=False)
    states = Counter(t.state for t in trials)
    assert states[TrialState.COMPLETE] + states[TrialState.PRUNED] == N_TRIALS, states
    assert states[TrialState.RUNNING] == states[TrialState.WAITING] == 0, states

    client = MlflowClient(chaos.base)
    experiment = client.get_experiment_by_name(NAME)
    runs = client.search_runs([experiment.experiment_id], max_results=5000)
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    parents = [r for r in runs if r.data.tags.get("sweeps.role") == "study"]
    assert [p.info.status for p in parents] == ["FINISHED"]
    children = [r for r in runs if r.data.tags.get("sweeps.role") == "trial"]
    per_number = Counter(int(r.data.tags["sweeps.trial_number"]) for r in children)
    assert max(per_number.values()) == 1, [n for n, c in per_number.items() if c > 1]  # no run made twice
    by_id = {r.info.run_id: r for r in children}
    by_id.update({r.data.tags["sweeps.client_run_id"]: r for r in children if "sweeps.client_run_id" in r.data.tags})

    problems = []
    for t in trials:
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED):
            continue
        run = by_id.get(t.user_attrs.get("mlflow_run_id", ""))
        if run is None:
            problems.append(f"trial {t.number}: no run")
            continue
        status = "FINISHED" if t.state == TrialState.COMPLETE else "KILLED"
        if run.info.status != status:
            problems.append(f"trial {t.number}: run {run.info.status}, not {status}")
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")]
        if steps != list(range(1, EPOCHS + 1)):
            problems.append(f"trial {t.number}: val_acc steps {steps}")
        model_id = run.data.tags.get("sweeps.model_id")
        if not model_id or client.get_logged_model(model_id).source_run_id != run.info.run_id:
            problems.append(f"trial {t.number}: no logged model")
        if not client.get_run(run.info.run_id).inputs.dataset_inputs:
            problems.append(f"trial {t.number}: no dataset inputs")
    assert problems == [], problems

    spooled = list((chaos.tmp / "runs" / ".mlflow_spool").glob("*.jsonl"))
    assert spooled == [], spooled  # nothing left to sync
    sync = subprocess.run([sys.executable, "-m", "sweeps.cli", "sync-tracking", "--uri", chaos.base], cwd=chaos.tmp,
                          env=chaos.env, capture_output=True, text=True, timeout=600)
    assert sync.returncode == 0, sync.stdout + sync.stderr
