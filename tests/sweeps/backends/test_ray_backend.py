"""The Ray Tune backend: unit tests of its pieces, then real studies on a local Ray
(ASHA pruning, a failing trial retried then failed, a driver killed with SIGKILL and
restored; a PBT study on a two-node cluster is in tests/scaleout/test_ray_token.py). Every Ray
process a test starts is killed by pid at the end (see the ``ray_tmp`` fixture); Ray runs with at
most 2 CPUs."""
from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.sweeps.backends.conftest import kill_ray_processes, mlflow_client, run_cli, study_runs, write_spec

pytestmark = pytest.mark.ray


def _spec(tmp_path, **overrides):
    from sweeps.spec.load import load_spec

    return load_spec(write_spec(tmp_path, backend="ray", **overrides))


# ---- pieces ---------------------------------------------------------------------------------------
def test_trial_names_count_from_zero_for_both_kinds_of_search():
    from sweeps.backends.ray_trainable import TrialNamer, number_of

    assert TrialNamer(0)(SimpleNamespace(experiment_tag="0_lr=0.1")) == "trial-0"  # BasicVariantGenerator
    assert TrialNamer(1)(SimpleNamespace(experiment_tag="1_lr=0.1")) == "trial-0"  # a Searcher counts from 1
    assert TrialNamer(1)(SimpleNamespace(experiment_tag="12_lr=0.1@perturbed[lr=0.2]")) == "trial-11"
    assert number_of("trial-11") == 11


def test_resources_per_trial(tmp_path):
    from sweeps.backends.ray_search import plan_resources
    from sweeps.errors import BackendError

    auto = _spec(tmp_path, resources={"devices": "auto", "workers": "auto"})
    assert plan_resources(auto, {"CPU": 8}) == plan_resources(auto, {"CPU": 8.0, "GPU": 0})
    r = plan_resources(auto, {"CPU": 8})
    assert (r.workers, r.cpus, r.gpus, r.threads) == (8, 1.0, 0.0, 1)  # one trial per CPU
    r = plan_resources(_spec(tmp_path, resources={"devices": "auto", "workers": "auto", "gpus_per_trial": 0.5}),
                       {"CPU": 8, "GPU": 2})
    assert (r.workers, r.gpus, r.cpus) == (4, 0.5, 2.0)  # four half-GPU trials share the CPUs
    r = plan_resources(_spec(tmp_path, resources={"devices": "auto", "workers": "auto", "cpus_per_trial": 1}),
                       {"CPU": 2, "GPU": 1})
    assert (r.workers, r.cpus, r.gpus) == (1, 1.0, 1.0)  # bounded by the one GPU
    r = plan_resources(_spec(tmp_path, resources={"devices": "cpu", "workers": 3}), {"CPU": 2, "GPU": 4})
    assert (r.workers, r.gpus, r.threads) == (3, 0.0, 1)
    with pytest.raises(BackendError, match="cpus_per_trial"):
        plan_resources(_spec(tmp_path, resources={"devices": "cpu", "cpus_per_trial": 4}), {"CPU": 2})
    with pytest.raises(BackendError, match="gpus_per_trial"):
        plan_resources(_spec(tmp_path, resources={"devices": "auto", "gpus_per_trial": 2}), {"CPU": 2, "GPU": 1})


def test_spec_refuses_what_ray_cannot_honour(tmp_path):
    from sweeps.errors import SpecError
    from sweeps.spec.load import load_spec

    cases = {
        "storage": ({"storage": "runs/x.journal"}, "storage: 'runs/x.journal' is the Optuna storage"),
        "oom": ({"budget": {"oom_retry_smaller_batch": True}}, "budget.oom_retry_smaller_batch"),
        "lr_finder": ({"lr_finder": {"enabled": True}}, "lr_finder.enabled"),
        "grid": ({"sampler": {"name": "grid"}, "budget": {"n_trials": 2},
                  "search": {"lr": {"type": "categorical", "choices": [0.1, 0.2, 0.3]}}},
                 "budget.n_trials: 2 is below the 3 points of the grid"),
        "devices on a cluster": ({"resources": {"devices": [0], "ray_address": "auto"}}, "resources.devices"),
    }
    for name, (overrides, message) in cases.items():
        with pytest.raises(SpecError) as err:
            load_spec(write_spec(tmp_path, name="bad", backend="ray", **overrides))
        assert message in str(err.value), name
    load_spec(write_spec(tmp_path, name="ok", backend="optuna", storage="runs/x.journal"))  # fine on optuna
    load_spec(write_spec(tmp_path, name="hangs", backend="ray", budget={"trial_timeout": "5m"}))  # works on Ray too


def test_samplers_and_pruners_map_to_ray(tmp_path):
    from ray.tune.schedulers import ASHAScheduler, HyperBandScheduler, MedianStoppingRule, PopulationBasedTraining
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    from sweeps.backends.ray_search import make_scheduler, make_search

    alg, space, n, first = make_search(_spec(tmp_path, budget={"n_trials": 5}), workers=2)
    assert isinstance(alg, BasicVariantGenerator) and set(space) == {"lr"} and (n, first) == (5, 0)
    grid = _spec(tmp_path, sampler={"name": "grid"}, budget={"n_trials": 3},
                 search={"lr": {"type": "categorical", "choices": [0.1, 0.2, 0.3]}})
    alg, space, n, first = make_search(grid, workers=2)
    assert space["lr"] == {"grid_search": [0.1, 0.2, 0.3]} and n == 1
    alg, space, n, first = make_search(_spec(tmp_path, sampler={"name": "tpe", "seed": 3}), workers=2)
    assert isinstance(alg, ConcurrencyLimiter) and space == {} and first == 1

    asha = make_scheduler(_spec(tmp_path, train={"epochs": 6},
                                pruner={"name": "asha", "min_resource": 2, "reduction_factor": 3}))
    assert isinstance(asha, ASHAScheduler) and asha._max_t == 6 and asha._reduction_factor == 3
    assert asha._brackets[0]._rungs[-1][0] == 2  # the first rung: after min_resource epochs
    hb = make_scheduler(_spec(tmp_path, train={"epochs": 6}, pruner={"name": "hyperband", "reduction_factor": 3}))
    assert isinstance(hb, HyperBandScheduler) and hb._max_t_attr == 6
    med = make_scheduler(_spec(tmp_path, train={"epochs": 6}, pruner={"name": "median", "warmup_epochs": 2}))
    assert isinstance(med, MedianStoppingRule) and med._grace_period == 2
    pbt = make_scheduler(_spec(tmp_path, train={"epochs": 6}, pruner={"name": "pbt", "perturbation_interval": 2},
                               search={"lr": {"type": "float", "low": 0.01, "high": 0.5, "log": True},
                                       "momentum": {"type": "float", "low": 0.5, "high": 0.95}}))
    assert isinstance(pbt, PopulationBasedTraining) and set(pbt._hyperparam_mutations) == {"lr", "momentum"}
    assert pbt._custom_explore_fn({"lr": 9.0, "momentum": 0.1}) == {"lr": 0.5, "momentum": 0.5}  # bounds hold


def test_pbt_exploit_rescales_the_checkpoint_to_the_new_lr(tmp_path):
    """The exploit copies another trial's checkpoint; training resumes at the new lr."""
    from core import checkpoint as ckpt
    from core.config import TrainConfig
    from core.tasks.base import make_task
    from core.train import train
    from sweeps.backends.ray_checkpoints import apply_new_hyperparams, restore_checkpoint

    for scheduler in ("constant", "onecycle", "cosine"):
        donor = tmp_path / f"donor-{scheduler}"
        cfg = TrainConfig(epochs=2, batch_size=256, lr=0.1, momentum=0.9, scheduler=scheduler, num_workers=0,
                          max_steps_per_epoch=2, device="cpu")
        train(make_task("digits", model="mlp", args={"width": 16}), cfg, out_dir=donor)
        (donor / "sweeps_checkpoint.json").write_text(json.dumps(
            {"trial_id": "donor", "number": 3, "params": {"lr": 0.1, "momentum": 0.9}}))
        before = ckpt.load_checkpoint(donor / "last.pt")
        me = tmp_path / f"me-{scheduler}"
        meta = restore_checkpoint(donor, me, {"lr": 0.2, "momentum": 0.8})
        assert meta["number"] == 3 and (me / "best.pt").exists()
        after = ckpt.load_checkpoint(me / "last.pt")
        g0, g1 = before["optimizer"]["param_groups"][0], after["optimizer"]["param_groups"][0]
        assert g1["lr"] == pytest.approx(2 * g0["lr"]) and g1["momentum"] == 0.8
        assert [2 * x for x in before["scheduler"].get("base_lrs", [1])] == \
            pytest.approx(after["scheduler"].get("base_lrs", [2]))
        assert json.loads(after["config_json"])["lr"] == 0.2
        assert not apply_new_hyperparams(me / "last.pt", {"lr": 0.2}, {"lr": 0.2})  # same values: untouched


def test_restore_falls_back_to_the_newest_checkpoint_that_still_exists(tmp_path):
    """Ray's snapshot written before a driver crash may name a checkpoint that num_to_keep
    has deleted since; the trial restores from its newest remaining one instead of failing."""
    from ray.train._internal.session import _TrainingResult
    from ray.tune import Checkpoint

    from sweeps.backends.ray_checkpoints import CKPT_META, existing_checkpoint

    trial = tmp_path / "trial-0-abc_00000"
    for index, epoch in ((1, 2), (2, 3)):
        folder = trial / f"checkpoint_{index:06d}"
        folder.mkdir(parents=True)
        (folder / CKPT_META).write_text(json.dumps({"epoch": epoch}))
    stale = _TrainingResult(checkpoint=Checkpoint.from_directory(str(trial / "checkpoint_000000")),
                            metrics={"training_iteration": 1})
    chosen = existing_checkpoint(stale)
    assert Path(chosen.checkpoint.path).name == "checkpoint_000002" and chosen.metrics["training_iteration"] == 3
    present = _TrainingResult(checkpoint=Checkpoint.from_directory(str(trial / "checkpoint_000001")), metrics={})
    assert existing_checkpoint(present) is present


# ---- real studies on a local Ray --------------------------------------------------------------------
def _children_by_number(tmp_path, name):
    parents, children = study_runs(tmp_path, name)
    assert len(parents) == 1
    return {int(c.data.tags["sweeps.trial_number"]): c for c in children}


@pytest.mark.slow
def test_asha_stops_weak_trials_early(tmp_path, ray_tmp, monkeypatch):
    from sweeps.backends.by_name import get_backend
    from sweeps.spec.load import load_spec

    # Two good learning rates first, then weak and diverging ones: ASHA (rungs after epochs
    # 1 and 3 of 6) stops the weak ones at a rung once better trials have reached it.
    lrs = [0.3, 0.1, 1.0e-4, 3.0e-4, 1.0e6, 1.0e-3]
    spec_path = write_spec(tmp_path, name="asha", backend="ray", train={"epochs": 6},
                           search={"lr": {"type": "categorical", "choices": lrs}},
                           sampler={"name": "grid"}, pruner={"name": "asha", "min_resource": 1, "reduction_factor": 3},
                           budget={"n_trials": len(lrs)}, resources={"devices": "cpu", "workers": 2})
    proc = run_cli(tmp_path, "run", str(spec_path), "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    result = get_backend("ray").load(load_spec(spec_path))
    runs = _children_by_number(tmp_path, "asha")
    assert sorted(t.number for t in result.trials) == list(range(len(lrs))) == sorted(runs)
    stopped = [t for t in result.trials if t.state == "PRUNED" and not t.reason.startswith("diverged")]
    assert stopped, [(t.number, t.state, t.reason, t.intermediate) for t in result.trials]
    for t in stopped:
        assert max(t.intermediate) < 6  # fewer epochs than the study trains
        run = runs[t.number]
        assert run.info.status == "FINISHED" and run.data.tags["sweeps.pruned"] == "true"
        assert run.data.tags["sweeps.state"] == "PRUNED"
    diverged = [t for t in result.trials if t.params["lr"] == 1.0e6]
    assert diverged[0].state == "PRUNED" and diverged[0].reason.startswith("diverged")
    for t in result.trials:
        if t.state == "COMPLETE":
            assert sorted(t.intermediate) == list(range(1, 7)) and runs[t.number].info.status == "FINISHED"
    assert {t.params["lr"] for t in result.trials if t.state == "COMPLETE"} >= {0.3}


@pytest.mark.slow
def test_failing_trial_is_retried_then_failed_while_others_complete(tmp_path, ray_tmp):
    from tests.sweeps.backends.flaky_task import ATTEMPTS_LOG, FAILING_WIDTH

    spec_path = write_spec(tmp_path, name="flaky", backend="ray",
                           task={"name": None, "target": "tests.sweeps.backends.flaky_task:make_task",
                                 "model": "mlp", "args": {}},
                           search={"task.width": {"type": "categorical", "choices": [16, FAILING_WIDTH, 32]}},
                           sampler={"name": "grid"}, budget={"n_trials": 3, "max_failures": 2},
                           resources={"devices": "cpu", "workers": 2})
    proc = run_cli(tmp_path, "run", str(spec_path), "--quiet")
    # One trial of the budget failed (fewer than max_failures in a row): the others ran, and the
    # exit code says that the budget did not finish.
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped with 2 of 3 trials finished: 1 failed" in proc.stdout, proc.stdout[-3000:]
    attempts = (tmp_path / ATTEMPTS_LOG).read_text().split()
    assert attempts.count(str(FAILING_WIDTH)) == 3  # the first try and two retries (max_failures: 2)
    assert attempts.count("16") == 1 and attempts.count("32") == 1
    runs = _children_by_number(tmp_path, "flaky")
    assert len(runs) == 3  # the retry continued the trial's own MLflow run
    states = {int(r.data.params["task.width"]): (r.info.status, r.data.tags["sweeps.state"])
              for r in runs.values()}
    assert states == {16: ("FINISHED", "COMPLETE"), 32: ("FINISHED", "COMPLETE"), FAILING_WIDTH: ("FAILED", "FAIL")}
    failed = next(r for r in runs.values() if r.data.tags["sweeps.state"] == "FAIL")
    assert "always fails" in failed.data.tags["sweeps.error"]

    status = run_cli(tmp_path, "status", str(spec_path))
    assert status.returncode == 0 and "always fails" in status.stdout, status.stdout + status.stderr


@pytest.mark.slow
def test_killed_or_timed_out_driver_resumes_without_rerunning_finished_trials(tmp_path, ray_tmp):
    """SIGKILL as Ray reports the first trial complete (before its experiment snapshot may hold
    it), then a run stopped by budget.timeout, then a run to the end: every trial has one MLflow
    run, FINISHED, and those finished before the kill were not run again."""
    import yaml

    from core.faults import Fault

    n_trials, epochs = 4, 3
    spec_path = write_spec(tmp_path, name="killed", backend="ray", train={"epochs": epochs, "batch_size": 16},
                           budget={"n_trials": n_trials}, resources={"devices": "cpu", "workers": 1})
    killed = run_cli(tmp_path, "run", str(spec_path), "--quiet", SWEEPS_FAULT=Fault.DRIVER_KILL_AFTER_TRIAL.value)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    # The trial Ray had just reported complete, by run id: its end time.
    finished = {c.info.run_id: c.info.end_time for c in study_runs(tmp_path, "killed")[1]
                if c.info.status == "FINISHED"}
    assert len(finished) == 1, finished
    # The killed driver's Ray processes (raylet, GCS, workers) share its fate; whatever
    # survives it is killed here, by pid, as `ray stop --force` would (only this instance).
    kill_ray_processes(ray_tmp)

    # budget.timeout stops this invocation the resumable way (exit 0, says how to go on)
    data = yaml.safe_load(spec_path.read_text())
    data["budget"]["timeout"] = "3s"
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    timed = run_cli(tmp_path, "run", str(spec_path), "--quiet")
    assert timed.returncode == 0 and "budget.timeout (3s) reached" in timed.stdout, timed.stdout + timed.stderr

    del data["budget"]["timeout"]
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = run_cli(tmp_path, "run", str(spec_path), "--quiet")
    logs = f"timed out run:\n{timed.stdout[-2500:]}\nlast run:\n{proc.stdout[-2500:]}{proc.stderr[-2500:]}"
    assert proc.returncode == 0, logs
    _, children = study_runs(tmp_path, "killed")
    numbers = [int(c.data.tags["sweeps.trial_number"]) for c in children]
    assert sorted(numbers) == list(range(n_trials)), logs  # one MLflow run per trial, none doubled
    bad = [(c.info.status, c.data.tags) for c in children
           if not (c.info.status == "FINISHED" and c.data.tags["sweeps.state"] == "COMPLETE")]
    assert not bad, f"{bad}\n{logs}"
    for c in children:
        assert [m.step for m in mlflow_client(tmp_path).get_metric_history(c.info.run_id, "val_acc")][-1] == epochs
        if c.info.run_id in finished:  # finished before the kill: not run again
            assert c.info.end_time == finished[c.info.run_id]
