"""The Pareto front of a study of several objectives in the tables and the report's figure: the
front is the one sweeps.pareto computes from the stored values, dominated trials are greyed."""
from __future__ import annotations

from dashboards.figures import DOMINATED_COLOR, FRONT_COLOR, all_figures, pareto_figure
from dashboards.page import PageHeader, render_page
from dashboards.tables import build_tables, trials_table
from sweeps.backends.base import StudyResult, TrialRecord

# (val_acc, latency): 0 and 2 trade one for the other; 1 is dominated by 0; 3 by 2; 4 failed.
VALUES = {0: [0.98, 0.05], 1: [0.97, 0.06], 2: [0.95, 0.01], 3: [0.95, 0.02]}


def _result(metrics=("val_acc", "onnx_latency_ms"), directions=("maximize", "minimize"), extra=()) -> StudyResult:
    trials = [TrialRecord(n, "COMPLETE", {"task.width": 8 * (n + 1)}, v[0], 1.0, f"run{n}",
                          values=[*v, *extra], figures={"params": 100.0 * (n + 1)}) for n, v in VALUES.items()]
    trials.append(TrialRecord(4, "PRUNED", {"task.width": 64}, None, 0.1, "run4", reason="rejected before training",
                              figures={"params": 9e6}, rejected=True))
    return StudyResult("s", "optuna", directions[0], metrics[0], trials, metrics=list(metrics),
                       directions=list(directions))


def test_front_and_table_columns():
    result = _result()
    assert [t.number for t in result.front()] == [0, 2]
    df = trials_table(result).set_index("number")
    assert df["on_front"].to_dict() == {0: True, 1: False, 2: True, 3: False, 4: False}
    assert df.loc[2, "objective:onnx_latency_ms"] == 0.01 and df["objective:val_acc"].isna().tolist()[-1]
    assert df["figure:params"].to_dict() == {0: 100.0, 1: 200.0, 2: 300.0, 3: 400.0, 4: 9e6}
    assert result.trials[0].objective_values(result.metrics) == {"params": 100.0, "val_acc": 0.98,
                                                                  "onnx_latency_ms": 0.05}
    # One objective: the table keeps its columns, and no front figure is drawn.
    single = StudyResult("s", "optuna", "maximize", "val_acc", result.trials)
    assert "on_front" not in trials_table(single).columns
    assert "fig-front" not in all_figures(build_tables(single))
    assert list(all_figures(build_tables(result)))[0] == "fig-front"  # several: the front comes first
    page = render_page(build_tables(result), PageHeader("s.yaml"))
    assert "<th>objective:onnx_latency_ms</th>" in page and "<th>figure:params</th>" in page
    assert "<th>objective:" not in render_page(build_tables(single), PageHeader("s.yaml"))


def test_two_objectives_draw_a_scatter_with_the_dominated_trials_grey():
    t = build_tables(_result())
    fig = all_figures(t)["fig-front"]
    dominated, front = fig.data
    assert front.name == "Pareto front" and front.marker.color == FRONT_COLOR
    assert list(front.x) == [0.01, 0.05] and list(front.y) == [0.95, 0.98]  # sorted along latency, joined by steps
    assert dominated.marker.color == DOMINATED_COLOR and sorted(dominated.x) == [0.02, 0.06]
    assert fig.layout.xaxis.title.text == "onnx_latency_ms" and fig.layout.yaxis.title.text == "val_acc"


def test_three_objectives_draw_parallel_coordinates():
    result = _result(("val_acc", "onnx_latency_ms", "params"), ("maximize", "minimize", "minimize"), extra=(1.0,))
    # Trial 3's params (1.0) ties everyone: 1 and 3 stay dominated by 0 and 2.
    fig = pareto_figure(trials_table(result), result.objectives(), ["task.width"])
    (coords,) = fig.data
    assert [d.label for d in coords.dimensions] == ["val_acc", "onnx_latency_ms", "params"]
    on_front = dict(zip(coords.dimensions[1].values, coords.line.color, strict=True))
    assert on_front == {0.06: 0, 0.02: 0, 0.05: 1, 0.01: 1}
