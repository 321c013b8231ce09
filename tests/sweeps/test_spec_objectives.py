"""Several objectives and constraints in a study spec (issue 28): the list form, the one-objective
form read as a one-element list, and the refused combinations, each named with its fix."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sweeps.errors import SpecError
from sweeps.spec.load import load_spec, spec_from_dict
from sweeps.spec.model import dump_spec_dict
from sweeps.spec.objectives import Bound
from tests.sweeps.test_spec import write

BASE = "name: t\ntask: {name: digits, model: cnn}\ntrain: {epochs: 2}\n"
TWO = "objectives: [{metric: val_acc, direction: maximize}, {metric: onnx_latency_ms, direction: minimize}]\n"


def problems_of(folder: Path, text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(write(folder, text))
    assert info.value.exit_code == 2
    assert str(folder / "spec.yaml") in str(info.value)  # the message names the file
    return info.value.problems


def test_single_objective_reads_as_a_one_element_list(tmp_path):
    spec = load_spec(write(tmp_path, BASE + "objective: {metric: val_loss, direction: minimize}\n"))
    assert [(o.metric, o.direction) for o in spec.objective_list()] == [("val_loss", "minimize")]
    assert spec.directions() == ["minimize"] and not spec.deploy_metrics_needed()
    assert spec.pruner.name == "median"  # the default, unchanged for one objective


def test_two_objectives_with_constraints(tmp_path):
    spec = load_spec(write(tmp_path, BASE + TWO + "constraints: {onnx_latency_ms: {max: 2.0}, params: {max: 1e6}}\n"
                           "deploy: {batch: 16}\n"))
    assert [o.metric for o in spec.objective_list()] == ["val_acc", "onnx_latency_ms"]
    assert spec.directions() == ["maximize", "minimize"]
    # Training follows the first trained objective, and a study of two objectives does not prune.
    assert spec.objective.metric == "val_acc" and spec.pruner.name == "none"
    assert spec.constraints == {"onnx_latency_ms": Bound(max=2.0), "params": Bound(max=1e6)}
    assert spec.deploy.batch == 16 and spec.deploy_metrics_needed()


def test_ray_runs_two_objectives_through_its_optuna_searcher(tmp_path):
    spec = load_spec(write(tmp_path, BASE + TWO + "backend: ray\nsampler: {name: tpe}\n"
                                              "search: {lr: {type: float, low: 0.01, high: 0.1}}\n"))
    assert spec.backend == "ray" and spec.pruner.name == "none" and spec.directions() == ["maximize", "minimize"]


def test_the_primary_objective_is_the_first_trained_one(tmp_path):
    spec = load_spec(write(tmp_path, BASE + "objectives: [{metric: params, direction: minimize}, "
                                            "{metric: val_loss, direction: minimize}]\n"))
    assert spec.objective.metric == "val_loss" and spec.objective.direction == "minimize"


def test_an_integer_bound_is_a_number(tmp_path):
    spec = load_spec(write(tmp_path, BASE + "constraints: {params: {max: 1000000, min: 10}}\n"))
    assert spec.constraints["params"] == Bound(min=10.0, max=1e6)
    assert spec.constraints["params"].violation(1_000_500) == 500 and spec.constraints["params"].violation(5) == 5
    assert spec.constraints["params"].violation(100) == 0


def test_dump_round_trips_and_old_specs_keep_their_hash(tmp_path):
    spec = load_spec(write(tmp_path, BASE + TWO + "constraints: {params: {max: 1e6}}\n"))
    dumped = json.loads(json.dumps(dump_spec_dict(spec, redact=False)))
    dumped.pop("resolved")
    again = spec_from_dict(dumped)
    assert again.spec_hash() == spec.spec_hash() and again.objective_list() == spec.objective_list()
    plain = load_spec(write(tmp_path, BASE))
    data = plain.model_dump(mode="json", exclude={"description": True, "objectives": True, "constraints": True,
                                                  "deploy": True, "resources": {"pack"}})
    # The hash of a spec without the new sections (and resources.pack) is what it was before they existed.
    assert plain.spec_hash() == hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"))
                                               .encode()).hexdigest()


CASES = {
    "both forms": (BASE + "objective: {metric: val_loss, direction: minimize}\n" + TWO,
                   ["objective: set together with objectives; keep one"]),
    "empty list": (BASE + "objectives: []\n", ["objectives: [] is empty"]),
    "deployment metric maximised": (BASE + "objectives: [{metric: val_acc, direction: maximize}, "
                                           "{metric: params, direction: maximize}]\n",
                                    ["objectives[1].direction: maximize but params is a deployment cost",
                                     "use direction: minimize"]),
    "unknown trained metric": (BASE + "objectives: [{metric: val_acc, direction: maximize}, "
                                      "{metric: val_acx, direction: maximize}]\n",
                               ["objectives[1].metric:", "val_acx", "did you mean 'val_acc'"]),
    "wrong direction of a trained metric": (BASE + "objectives: [{metric: val_loss, direction: maximize}, "
                                                   "{metric: params, direction: minimize}]\n",
                                            ["objectives[0].direction: maximize contradicts 'val_loss'",
                                             "use direction: minimize"]),
    "only deployment metrics": (BASE + "objectives: [{metric: params, direction: minimize}]\n",
                                ["objectives: only deployment metrics (params)", "add one such as"]),
    "listed twice": (BASE + "objectives: [{metric: val_acc, direction: maximize}, "
                            "{metric: val_acc, direction: maximize}]\n",
                     ["objectives[1].metric: 'val_acc' is listed twice"]),
    "constraint on a trained metric": (BASE + "constraints: {val_acc: {min: 0.9}}\n",
                                       ["constraints.val_acc: 'val_acc' is not a deployment metric",
                                        "onnx_latency_ms", "sweeps promote --where"]),
    "constraint without a bound": (BASE + "constraints: {params: {}}\n", ["constraints.params: no bound"]),
    "min above max": (BASE + "constraints: {params: {min: 10, max: 5}}\n",
                      ["constraints.params.min: 10 is above max 5", "use min <= max"]),
    "a max no model meets": (BASE + "constraints: {params: {max: -1}}\n",
                             ["constraints.params.max: -1 rejects every model", "use a bound above 0"]),
    "gpu latency on cpu": (BASE + "resources: {devices: cpu}\nconstraints: {gpu_latency_ms: {max: 1}}\n",
                           ["constraints.gpu_latency_ms: gpu_latency_ms needs a GPU, but resources.devices is cpu"]),
    "misspelt bound": (BASE + "constraints: {params: {mx: 5}}\n", ["constraints.params.mx: unknown key",
                                                                   "did you mean 'max'"]),
    "batch latency at another batch": (BASE + "deploy: {batch: 8}\nconstraints: {onnx_latency_b16_ms: {max: 3}}\n",
                                       ["constraints.onnx_latency_b16_ms: 'onnx_latency_b16_ms' is measured at "
                                        "batch 16 but deploy.batch is 8", "onnx_latency_b8_ms"]),
    "asha with two objectives": (BASE + TWO + "pruner: {name: asha}\n",
                                 ["pruner.name: asha stops trials by one number, but the study has 2 objectives",
                                  "use pruner: {name: none}", "as constraints"]),
    "median with two objectives": (BASE + TWO + "pruner: {name: median}\n", ["pruner.name: median stops trials"]),
    "cmaes with two objectives": (BASE + TWO + "sampler: {name: cmaes}\n",
                                  ["sampler.name: cmaes optimises one objective, the study has 2",
                                   "tpe, gp, random, grid, qmc"]),
    "ray asha with two objectives": (BASE + TWO + "backend: ray\npruner: {name: asha}\n",
                                     ["pruner.name: asha stops trials by one number", "use pruner: {name: none}"]),
    "ray pbt with two objectives": (BASE + TWO + "backend: ray\npruner: {name: pbt}\nsampler: {name: random}\n"
                                    "search: {lr: {type: float, low: 0.01, high: 0.1}}\n",
                                    ["pruner.name: pbt stops trials by one number"]),
    "ray with constraints": (BASE + "backend: ray\nconstraints: {params: {max: 1e6}}\n",
                             ["constraints: not supported on backend ray", "use backend: optuna"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_its_message(tmp_path, case):
    text, expected = CASES[case]
    problems = "\n".join(problems_of(tmp_path, text))
    for part in expected:
        assert part in problems, (part, problems)


def test_problem_names_its_line(tmp_path):
    problems = problems_of(tmp_path, BASE + "constraints:\n  params: {min: 10, max: 5}\n")
    assert problems == ["constraints.params.min: 10 is above max 5; use min <= max (line 5)"]


# ---- a resumed study keeps what its trials are judged by (both backends) -----------------------------
def _judged_spec(tmp_path, second: str = "onnx_latency_ms", constraints: dict | None = None,
                 backend: str = "optuna"):
    return spec_from_dict({
        "name": "judged", "backend": backend, "task": {"name": "digits", "model": "cnn"},
        "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
        "objectives": [{"metric": "val_acc", "direction": "maximize"}, {"metric": second, "direction": "minimize"}],
        "constraints": constraints or {}, "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
        **({"storage": str(tmp_path / "judged.journal")} if backend == "optuna" else {})})


@pytest.mark.parametrize("changed", [{"second": "params"}, {"constraints": {"params": {"max": 1000}}}],
                         ids=["a metric swapped", "a constraint tightened"])
def test_a_study_resumed_with_other_objectives_or_constraints_is_refused(tmp_path, changed):
    from sweeps.backends import optuna_study
    from sweeps.errors import StudyStateError

    optuna_study.open_study(_judged_spec(tmp_path, constraints={"params": {"max": 60000}}))
    kwargs = {"constraints": {"params": {"max": 60000}}, **changed}
    with pytest.raises(StudyStateError, match="changed since it started.*--fresh") as info:
        optuna_study.open_study(_judged_spec(tmp_path, **kwargs))
    assert ("objectives" if "second" in changed else "constraints") in str(info.value)
    optuna_study.open_study(_judged_spec(tmp_path, constraints={"params": {"max": 60000}}))  # unchanged: resumes
    assert optuna_study.open_study(_judged_spec(tmp_path, **kwargs), fresh=True).study_name == "judged-v2"


def test_a_ray_study_resumed_with_other_objectives_is_refused(tmp_path, monkeypatch):
    from sweeps.backends import ray_records as rr
    from sweeps.backends.ray_backend import RayBackend
    from sweeps.errors import StudyStateError

    monkeypatch.chdir(tmp_path)
    backend = RayBackend()
    meta = backend._checked_meta(_judged_spec(tmp_path, backend="ray"), "judged")
    (rr.ray_root() / "judged").mkdir(parents=True)
    rr.write_meta("judged", meta)
    assert backend._checked_meta(_judged_spec(tmp_path, backend="ray"), "judged") == meta
    with pytest.raises(StudyStateError, match="study 'judged' changed since it started: objectives"):
        backend._checked_meta(_judged_spec(tmp_path, second="params", backend="ray"), "judged")


def test_a_trial_without_an_objectives_value_is_told_which_and_why(tmp_path):
    from sweeps.deploy_check import missing_objectives, objective_values

    spec = spec_from_dict({"name": "gpu", "task": {"name": "digits", "model": "cnn"},
                           "search": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
                           "objectives": [{"metric": "val_acc", "direction": "maximize"},
                                          {"metric": "gpu_latency_ms", "direction": "minimize"}]})
    history = [{"epoch": 1, "val_acc": 0.5}, {"epoch": 2, "val_acc": float("nan")}]
    figures = {"onnx_latency_ms": 0.1, "params": 1000.0}  # no GPU here: no gpu_latency_ms
    assert objective_values(spec, history, 1, figures) is None
    assert missing_objectives(spec, history, 1, figures) == [
        "gpu_latency_ms (not measured on this machine: it needs a GPU that onnxruntime can use)"]
    assert missing_objectives(spec, history, 2, {**figures, "gpu_latency_ms": 0.01}) == [
        "val_acc (NaN or not reported at the best epoch)"]
    assert objective_values(spec, history, 1, {**figures, "gpu_latency_ms": 0.01}) == [0.5, 0.01]


@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_a_constrained_studys_sampler_is_made_without_optunas_deprecated_constraints_func(sampler):
    import warnings

    from sweeps.backends.optuna_sampler import make_sampler
    from sweeps.deploy_check import constraint_values

    spec = spec_from_dict({"name": "c", "task": {"name": "digits"}, "constraints": {"params": {"max": 5000}},
                           "search": {"lr": {"type": "float", "low": 1e-3, "high": 0.1}},
                           "sampler": {"name": sampler}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        make_sampler(spec)
    assert constraint_values(spec.constraints, {"params": 85002.0}) == {"params": 80002.0}
    assert constraint_values(spec.constraints, {}) == {"params": 0.0}  # failed before it was measured
