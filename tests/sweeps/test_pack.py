"""``resources.pack``: the spec's rules (fast) and a packed study end to end through `sweeps run`
(slow): every member a whole trial, with its own Optuna trial, MLflow run, curves, checkpoint,
ONNX export, logged model and pruning decision."""
from __future__ import annotations

import pytest

from sweeps.errors import SpecError
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import cli_in_process, load_study, mlflow_runs, tiny_spec, write_spec

DIABETES = {"task": {"name": "diabetes", "model": "mlp", "args": {"width": 16}},
            "train": {"epochs": 3, "batch_size": 32, "optimizer": "adamw", "scheduler": "cosine",
                      "num_workers": 0, "export_onnx": True, "seed": 0},
            "search": {"lr": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True},
                       "weight_decay": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True}},
            "objective": {"metric": "val_rmse", "direction": "minimize"}}


def _spec(**overrides):
    return spec_from_dict(tiny_spec("packed", **{**DIABETES, **overrides}))


def test_pack_sizes():
    assert _spec().resources.pack_size() == 1
    assert _spec(resources={"pack": 4}).resources.pack_size() == 4
    assert _spec(resources={"pack": "auto"}).resources.pack_size() == 16


_DIGITS = {"task": {"name": "digits", "model": "cnn", "args": {}},
           "objective": {"metric": "val_acc", "direction": "maximize"}}


@pytest.mark.parametrize("study, pack, unpacked", [(_DIGITS, "auto", True), (_DIGITS, 4, False), ({}, "auto", False)])
def test_auto_packs_no_convolutional_model_on_a_cpu(study, pack, unpacked):
    from sweeps.trial import trial_config
    from sweeps.trial_population import auto_problem

    spec = _spec(**study, resources={"pack": pack, "devices": "cpu"})
    cfg = trial_config(spec, {"lr": 0.01, "weight_decay": 1e-4})
    problem = auto_problem(spec, spec.make_task({}), cfg)
    assert (problem is not None) == unpacked
    if unpacked:
        assert "convolutional model unpacked on a CPU" in problem and "set a number" in problem


def test_pack_leaves_the_hash_of_a_spec_without_it():
    plain = _spec()
    assert plain.spec_hash() == _spec(resources={"pack": None}).spec_hash()
    assert plain.spec_hash() != _spec(resources={"pack": 4}).spec_hash()


@pytest.mark.parametrize("overrides, words", [
    ({"resources": {"pack": 0}}, "resources.pack"),
    ({"resources": {"pack": "many"}}, "use a number of trials trained together"),
    ({"backend": "ray", "resources": {"pack": 4}}, "not supported on backend ray"),
    ({"resources": {"pack": 4}, "train": {**DIABETES["train"], "profile": {}}}, "train.profile"),
    ({"resources": {"pack": 4}, "train": {**DIABETES["train"], "distributed": {"nproc": 2}}}, "DDP"),
    ({"resources": {"pack": 4}, "train": {**DIABETES["train"], "mixup_alpha": 0.2}}, "mixup"),
])
def test_what_pack_cannot_do_is_a_spec_error(overrides, words):
    with pytest.raises(SpecError) as info:
        _spec(**overrides)
    assert words in str(info.value)
    assert info.value.exit_code == 2


@pytest.mark.slow
def test_packed_study_keeps_every_trial_whole(tmp_path):
    spec = write_spec(tmp_path, "packed", **DIABETES, budget={"n_trials": 6, "max_failures": 3},
                      pruner={"name": "median", "warmup_epochs": 1}, resources={"pack": 4, "workers": 1})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = load_study(tmp_path, "packed")
    trials = study.trials
    assert len(trials) == 6 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    packs = [t.user_attrs["pack"] for t in trials]
    # Asked four at once, then the last two of the budget: two populations, each one grouped model.
    assert packs[0] == "packed with trials 1, 2, 3 (grouped layers)"
    assert packs[4] == "packed with trials 5 (grouped layers)"
    runs = {int(r.data.tags["sweeps.trial_number"]): r for r in mlflow_runs(tmp_path, "packed")
            if r.data.tags.get("sweeps.role") == "trial"}
    assert sorted(runs) == list(range(6))
    for t in trials:
        run = runs[t.number]
        assert run.data.tags["sweeps.pack"] == t.user_attrs["pack"]
        assert run.data.params["lr"] == str(t.params["lr"])
        assert run.data.tags["sweeps.state"] == t.state.name
        if t.state.name == "COMPLETE":
            assert run.data.metrics["objective"] == pytest.approx(t.value)
            assert run.data.tags["sweeps.onnx_parity_passed"] == "true"
            assert (tmp_path / "runs" / "packed" / f"trial-{t.number:04d}" / "best.pt").exists()
            assert "sweeps.model_id" in run.data.tags
    # Each member has its own curves: the members differ (their own lr and weight decay).
    assert len({round(runs[n].data.metrics["train_loss"], 6) for n in runs}) == 6


def _all_running_checkpointed(folder, name: str, n: int):
    """The n RUNNING trials once each has a checkpoint (a durable state), else None."""
    if not (folder / "runs" / f"{name}.journal").exists():
        return None
    try:
        trials = load_study(folder, name).trials
    except Exception:  # noqa: BLE001 - the journal may be mid-write while the study runs: poll again
        return None
    running = [t for t in trials if t.state.name == "RUNNING"
               and (folder / t.user_attrs.get("out_dir", "/nonexistent") / "last.pt").exists()]
    return running if len(running) == n else None


@pytest.mark.slow
def test_a_stopped_population_resumes_each_member_from_its_checkpoint(tmp_path):
    import signal
    import time

    from tests.sweeps.study_helpers import start_cli

    wide = {**DIABETES, "task": {**DIABETES["task"], "args": {"width": 512}},
            "train": {**DIABETES["train"], "epochs": 8, "export_onnx": False}}
    spec = write_spec(tmp_path, "stopped", **wide, budget={"n_trials": 3, "max_failures": 3},
                      resources={"pack": 3, "workers": 1})
    proc = start_cli(tmp_path, "run", str(spec), "--quiet")  # a process of its own: SIGTERM stops it
    while not _all_running_checkpointed(tmp_path, "stopped", 3):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate()
    assert proc.returncode == 143, out
    failed = [t for t in load_study(tmp_path, "stopped").trials if t.state.name == "FAIL"]
    assert len(failed) == 3 and all("interrupted" in t.user_attrs["fail_reason"] for t in failed)

    again = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert again.returncode == 0, again.stdout + again.stderr
    trials = load_study(tmp_path, "stopped").trials
    retries = [t for t in trials if t.system_attrs.get("failed_trial") is not None]
    assert len(retries) == 3 and {t.state.name for t in retries} == {"COMPLETE"}
    assert all(t.user_attrs["pack"].startswith("packed with trials") for t in retries)
    runs = {int(r.data.tags["sweeps.trial_number"]): r for r in mlflow_runs(tmp_path, "stopped")
            if r.data.tags.get("sweeps.role") == "trial"}
    for t in retries:  # each member went on from its own checkpoint, its run holding the whole curve
        run = runs[t.number]
        assert int(run.data.tags["sweeps.resumed_from_epoch"]) >= 1
        assert run.data.tags["sweeps.state"] == "COMPLETE"


@pytest.mark.parametrize("n_trials, pool, asked", [(16, 2, 8), (64, 2, 16), (5, 1, 5), (3, 4, 1)])
def test_a_worker_asks_its_share_of_the_budget(n_trials, pool, asked):
    import optuna

    from sweeps.backends.optuna_pack import ask_more
    from sweeps.backends.trial_liveness import HeldTrials

    study = optuna.create_study()
    study.ask()  # the worker's first trial
    more = ask_more(_spec(resources={"pack": 16}), study, HeldTrials(study), n_trials, pool)
    assert 1 + len(more) == asked
    assert all(t.user_attrs["worker"] for t in more)


@pytest.mark.parametrize("sampler, n_trials, pool, asked", [
    ("tpe", 64, 2, 8), ("gp", 64, 2, 8), ("tpe", 16, 2, 2), ("tpe", 2000, 2, 16), ("tpe", 3, 1, 1),
    ("tpe", 10, 2, 1), ("tpe", 6, 1, 1), ("tpe", 9, 1, 2),
    ("random", 64, 2, 16), ("qmc", 64, 2, 16), ("cmaes", 64, 2, 16)])
def test_a_sampler_that_models_the_results_gets_four_rounds_of_them(sampler, n_trials, pool, asked):
    from sweeps.backends.optuna_pack import FEEDBACK_ROUNDS, ask_size

    spec = _spec(resources={"pack": 16}, sampler={"name": sampler, "seed": 0})
    assert ask_size(spec, n_trials, pool) == asked
    if sampler in ("tpe", "gp") and n_trials <= 16 * pool * FEEDBACK_ROUNDS:  # the budget takes four rounds of asks
        assert -(-n_trials // (asked * pool)) >= min(FEEDBACK_ROUNDS, -(-n_trials // pool))  # or as many as it has
