"""Two objectives on the Ray backend (issue 28): OptunaSearch with a list of metrics, told each
trial's final values; the records, the front and status read them back."""
from __future__ import annotations

import json

import pytest

from sweeps.pareto import pareto_front
from tests.sweeps.backends.conftest import run_cli, study_runs, write_spec
from tests.sweeps.study_helpers import cli_in_process

pytestmark = pytest.mark.ray

TWO = [{"metric": "val_acc", "direction": "maximize"}, {"metric": "onnx_latency_ms", "direction": "minimize"}]
SEARCH = {"lr": {"type": "float", "low": 0.05, "high": 0.5, "log": True},
          "task.width": {"type": "categorical", "choices": [8, 256]}}


def _spec(tmp_path, **overrides):
    path = write_spec(tmp_path, name="mo_ray", backend="ray", objectives=TWO, search=SEARCH,
                      sampler={"name": "tpe", "seed": 0}, deploy={"runs": 20, "batch": 8},
                      task={"name": "digits", "model": "mlp", "args": {}}, **overrides)
    text = path.read_text().replace("objective:\n  metric: val_acc\n  direction: maximize\n", "")
    path.write_text(text)
    return path


def test_the_optuna_searcher_gets_a_list_of_metrics(tmp_path):
    from ray.tune.search import ConcurrencyLimiter

    from sweeps.backends.ray_search import make_search
    from sweeps.spec.load import load_spec

    spec = load_spec(_spec(tmp_path))
    assert spec.objective_list()[1].metric == "onnx_latency_ms" and "objective" not in spec.model_fields_set
    alg, space, n, first = make_search(spec, workers=1)
    assert isinstance(alg, ConcurrencyLimiter) and space == {} and (n, first) == (3, 1)
    assert alg.searcher.metric == ["sweeps_objective_0", "sweeps_objective_1"] and alg.searcher.mode == ["max", "min"]


@pytest.mark.slow
def test_a_two_objective_study_on_ray(tmp_path, ray_tmp):
    spec = _spec(tmp_path, budget={"n_trials": 3, "max_failures": 1}, resources={"devices": "cpu", "workers": 1})
    proc = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = cli_in_process(tmp_path, "status", str(spec), "--format", "json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    _, children = study_runs(tmp_path, "mo_ray")
    runs = {int(r.data.tags["sweeps.trial_number"]): r for r in children}
    rows = [r for r in doc["trials"] if r["state"] == "COMPLETE"]
    assert len(rows) == 3 and doc["objectives"] == TWO
    for row in rows:
        run = runs[row["number"]]
        # The values Ray's searcher was told are the trial's own: val_acc at its best epoch, the latency measured.
        assert row["objective:val_acc"] == pytest.approx(run.data.metrics["objective"])
        assert row["objective:onnx_latency_ms"] == pytest.approx(run.data.metrics["onnx_latency_ms"])
    points = [[r["objective:val_acc"], r["objective:onnx_latency_ms"]] for r in rows]
    assert doc["front"] == sorted(rows[i]["number"] for i in pareto_front(points, ["maximize", "minimize"]))
    for row in rows:
        assert runs[row["number"]].data.tags["sweeps.pareto_front"] == str(row["number"] in doc["front"]).lower()
