"""The report's tables on hand-made studies (no training, no MLflow): fast checks of the rules."""
from __future__ import annotations

import io
import math

import pandas as pd
import pytest

from dashboards.figures import all_figures
from dashboards.page import PageHeader, question_of, render_page, write_page
from dashboards.tables import (
    best_so_far_table,
    build_tables,
    importances_table,
    ranked_trials,
    state_counts_table,
    table_records,
    top_two_params,
    trials_table,
)
from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.spec.search_space import CategoricalParam, FloatParam

SEARCH = {"lr": FloatParam(type="float", low=1e-4, high=1.0, log=True),
          "batch_size": CategoricalParam(type="categorical", choices=[16, 32, 64])}


def _result(direction: str = "maximize") -> StudyResult:
    t = TrialRecord
    trials = [
        t(2, "PRUNED", {"lr": 1e-4, "batch_size": 64}, 0.30, 1.0, "r2", {1: 0.2, 2: 0.3}, "pruned after epoch 2"),
        t(0, "COMPLETE", {"lr": 0.01, "batch_size": 16}, 0.80, 5.0, "r0", {1: 0.5, 2: 0.7, 3: 0.8}),
        t(1, "COMPLETE", {"lr": 0.1, "batch_size": 32}, 0.90, 6.0, "r1", {1: 0.6, 2: 0.85, 3: 0.9}),
        t(3, "FAIL", {"lr": 0.5, "batch_size": 16}, None, 0.5, "r3", {}, "CUDA out of memory"),
        t(4, "COMPLETE", {"lr": 0.05, "batch_size": 64}, 0.85, 5.5, "r4", {1: 0.55, 2: 0.8, 3: 0.85}),
        t(5, "RUNNING", {"lr": 0.2, "batch_size": 32}, None, None, "r5", {1: 0.6}),
    ]
    return StudyResult("toy", "optuna", direction, "val_acc", trials, parent_run_id=None)


def test_trials_table_has_one_row_per_trial_with_params_and_the_best_marked():
    df = trials_table(_result(), SEARCH)
    assert list(df["number"]) == [0, 1, 2, 3, 4, 5]
    assert list(df.columns) == ["number", "state", "value", "lr", "batch_size", "duration_s", "run_id", "is_best",
                                "reason"]
    assert df["is_best"].sum() == 1 and int(df.loc[df["is_best"], "number"].iloc[0]) == 1
    assert math.isnan(df.loc[df["number"] == 3, "value"].iloc[0])
    assert df.loc[df["number"] == 2, "reason"].iloc[0] == "pruned after epoch 2"


def test_ranked_trials_orders_like_sweeps_status():
    df = ranked_trials(trials_table(_result(), SEARCH), "maximize")
    assert list(df["number"]) == [1, 4, 0, 2, 3, 5]
    df = ranked_trials(trials_table(_result("minimize"), SEARCH), "minimize")
    assert list(df["number"])[:3] == [0, 4, 1]


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_best_so_far_is_monotone_and_counts_only_complete_trials(direction):
    df = best_so_far_table(trials_table(_result(direction), SEARCH), direction)
    assert list(df["number"]) == [0, 1, 2, 3, 4]  # finished trials only (5 is running)
    best = df["best_so_far"].dropna()
    assert best.is_monotonic_increasing if direction == "maximize" else best.is_monotonic_decreasing
    if direction == "maximize":
        assert list(df["best_so_far"]) == [0.8, 0.9, 0.9, 0.9, 0.9]
    else:  # the pruned trial's 0.3 is lower but not a completed result
        assert list(df["best_so_far"]) == [0.8, 0.8, 0.8, 0.8, 0.8]


def test_state_counts_match_the_study():
    result = _result()
    df = state_counts_table(trials_table(result, SEARCH))
    assert dict(zip(df["state"], df["count"], strict=True)) == result.counts()
    assert list(df["state"]) == ["COMPLETE", "PRUNED", "FAIL", "RUNNING"]
    assert df.loc[df["state"] == "COMPLETE", "total_duration_s"].iloc[0] == pytest.approx(16.5)


def test_importances_from_enough_completed_trials_use_their_values():
    result = _result()
    result.trials.append(TrialRecord(6, "COMPLETE", {"lr": 0.002, "batch_size": 16}, 0.70, 4.0, "r6",
                                     {1: 0.3, 2: 0.5, 3: 0.7}))
    df, note = importances_table(result, SEARCH)
    assert set(df["param"]) == {"lr", "batch_size"} and df["importance"].sum() == pytest.approx(1.0)
    assert (df["importance"] >= 0).all() and df["importance"].is_monotonic_decreasing
    assert note == "from 4 completed trials, each at its val_acc at its best epoch"


def test_importances_with_few_completed_trials_add_pruned_ones_at_a_common_epoch():
    # 3 completed trials (fewer than 4): the pruned trial 2 reached epoch 2, so all 4 count there.
    df, note = importances_table(_result(), SEARCH)
    assert set(df["param"]) == {"lr", "batch_size"} and df["importance"].sum() == pytest.approx(1.0)
    assert note == ("from 4 trials (3 completed, 1 pruned; only 3 completed, so epoch 2 is the deepest epoch "
                    "that at least 4 trials reached), each at its val_acc after epoch 2")
    fig = all_figures(build_tables(_result(), SEARCH, reader=None))["fig-importances"]
    assert fig.layout.annotations[0].text.replace("<br>", " ") == note


def test_importances_of_pruned_trials_explain_their_common_epoch_not_their_last():
    # One completed trial; six pruned after epoch 1 or 2. After epoch 1 the value follows lr alone,
    # after epoch 2 batch size alone: the importances must come from epoch 1, which all 7 reached,
    # not from each trial's last or best value.
    t = TrialRecord
    trials = [t(0, "COMPLETE", {"lr": 0.1, "batch_size": 32}, 0.95, 5.0, "r0", {1: 0.46, 2: 0.93, 3: 0.95})]
    for i, (lr, bs) in enumerate([(1e-4, 16), (3e-4, 32), (1e-3, 64), (3e-3, 16), (1e-2, 32), (0.3, 64)], 1):
        curve = {1: 0.1 + 0.12 * (4 + math.log10(lr))}
        if i in (1, 3):  # with trial 0, three trials reached epoch 2: too few
            curve[2] = {16: 0.2, 32: 0.5, 64: 0.8}[bs]
        trials.append(t(i, "PRUNED", {"lr": lr, "batch_size": bs}, max(curve.values()), 1.0, f"r{i}", curve))
    df, note = importances_table(StudyResult("p", "optuna", "maximize", "val_acc", trials), SEARCH)
    assert note == ("from 7 trials (1 completed, 6 pruned; only 1 completed, so epoch 1 is the deepest epoch "
                    "that at least 4 trials reached), each at its val_acc after epoch 1")
    # fANOVA's forest over 7 points (seed 0) gives lr 0.78: batch size explains little at epoch 1.
    assert df.iloc[0]["param"] == "lr" and df.iloc[0]["importance"] > 0.7


def test_importances_need_two_trials_at_a_common_epoch():
    one = _result()
    one.trials = [t for t in one.trials if t.number in (0, 3, 5)]  # one completed, one failed, one running
    df, note = importances_table(one, SEARCH)
    assert df.empty and note == ("parameter importances need at least 2 completed trials, or 2 trials that "
                                 "reached a common epoch; this study has 1 completed")


def test_importances_say_why_when_the_trials_leave_nothing_to_explain():
    t = TrialRecord
    same = StudyResult("same", "optuna", "maximize", "val_acc", [
        t(0, "COMPLETE", {"lr": 0.01, "batch_size": 16}, 0.80, 1.0, "r0", {}),
        t(1, "COMPLETE", {"lr": 0.01, "batch_size": 16}, 0.82, 1.0, "r1", {})])
    df, note = importances_table(same, SEARCH)
    assert df.empty and "importances are unavailable" in note
    assert "all 2 completed trials have the same parameters (lr=0.01, batch_size=16)" in note
    flat = StudyResult("flat", "optuna", "maximize", "val_acc", [
        t(0, "COMPLETE", {"lr": 0.01, "batch_size": 16}, 0.80, 1.0, "r0", {}),
        t(1, "COMPLETE", {"lr": 0.1, "batch_size": 32}, 0.80, 1.0, "r1", {})])
    df, note = importances_table(flat, SEARCH)
    assert df.empty and "all 2 completed trials reached the same val_acc (0.8)" in note
    fig = all_figures(build_tables(same, SEARCH, reader=None))["fig-importances"]
    shown = fig.layout.annotations[0].text.replace("<br>", " ")
    assert shown == importances_table(same, SEARCH)[1]


def test_tables_without_mlflow_fall_back_to_the_intermediate_values():
    t = build_tables(_result(), SEARCH, reader=None)
    curves = t.curves
    assert sorted(curves["number"].unique()) == [0, 1, 2, 4, 5]  # the failed trial has no point
    assert list(curves.loc[curves["number"] == 2, "val_acc"]) == [0.2, 0.3]
    assert curves.loc[curves["number"] == 1, "epoch"].tolist() == [1, 2, 3]
    assert t.lr_finder.empty and t.lr_finder_info == {}
    assert top_two_params(t) == ["lr", "batch_size"]


def test_every_figure_is_drawn_even_from_empty_tables(tmp_path):
    empty = StudyResult("empty", "optuna", "maximize", "val_acc", [])
    t = build_tables(empty, SEARCH, reader=None)
    figs = all_figures(t)
    assert figs["fig-lr-finder"] is None and all(f is not None for k, f in figs.items() if k != "fig-lr-finder")
    page = render_page(t, PageHeader(spec_path="studies/x.yaml"))
    assert "No completed trial yet" in page and "lr_finder: {enabled: true}" in page
    path = write_page(page, tmp_path / "sub" / "report.html")
    assert path.read_text() == page and [p.name for p in path.parent.iterdir()] == ["report.html"]


def test_page_escapes_what_the_user_wrote():
    t = build_tables(_result(), SEARCH, reader=None)
    page = render_page(t, PageHeader(spec_path="s.yaml", description="<script>alert(1)</script>",
                                     question="a < b?"))
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a &lt; b?" in page
    assert "sweeps promote s.yaml" in page and "sweeps rerun s.yaml --trial 1" in page


def test_question_is_the_first_question_comment_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("# Run: sweeps run s.yaml\n#  Question:  which lr?  \n# Question: second\nname: s\n")
    assert question_of(spec) == "which lr?"
    spec.write_text("name: s\n")
    assert question_of(spec) == "" and question_of(tmp_path / "missing.yaml") == ""


def test_trials_table_keeps_types_for_csv_round_trip(tmp_path):
    df = trials_table(_result(), SEARCH)
    back = pd.read_csv(io.StringIO(df.to_csv(index=False)))
    assert back["number"].tolist() == df["number"].tolist()
    assert back["is_best"].tolist() == df["is_best"].tolist()


def test_lr_finder_figure_marks_the_suggestion_and_clips_the_explosion():
    import dataclasses

    from dashboards.figures import lr_finder_curve

    t = build_tables(_result(), SEARCH, reader=None)
    lrs = [1e-5 * 10 ** (i / 4) for i in range(21)]  # 1e-5 .. 1
    losses = [2.3 - 1.8 * min(i, 14) / 14 for i in range(20)] + [1e4]  # falls to 0.5, then explodes
    lr = pd.DataFrame({"lr": lrs, "loss": losses, "smoothed": losses, "suggestion": [1e-3] * 21})
    fig = lr_finder_curve(dataclasses.replace(t, lr_finder=lr, lr_finder_info={"suggestion": 1e-3, "rule": "valley"}))
    lo, hi = fig.layout.yaxis.range
    assert lo < 0.5 and 2.3 < hi < 10  # the whole descent in view, the explosion cut off
    marks = [tr for tr in fig.data if tr.name.startswith("suggestion")]
    assert len(marks) == 1 and list(marks[0].x) == [1e-3, 1e-3] and "valley" in marks[0].name
    assert fig.layout.xaxis.type == "log"


def test_table_records_are_plain_json_values():
    import json

    records = table_records(trials_table(_result(), SEARCH))
    assert records[3]["value"] is None and records[0]["is_best"] is False and records[1]["is_best"] is True
    assert type(records[0]["number"]) is int and records[0]["lr"] == 0.01
    json.dumps(records)  # no numpy scalars, no NaN


def test_a_run_missing_from_mlflow_falls_back_to_the_study_values():
    from dashboards.mlflow_tables import curves_table, lr_finder_table

    class Missing(Exception):
        error_code = "RESOURCE_DOES_NOT_EXIST"

    class Reader:  # the TrackingReader calls the tables make, on a store that lost the runs
        def metric_history(self, run_id, key):
            raise Missing(run_id)

        def list_artifacts(self, run_id, path=None):
            raise Missing(run_id)

    curves = curves_table(_result(), Reader())
    assert list(curves.loc[curves["number"] == 0, "val_acc"]) == [0.5, 0.7, 0.8]
    assert curves["val_loss"].isna().all()
    df, info = lr_finder_table(Reader(), "gone")
    assert df.empty and info == {}


def test_the_page_says_whether_the_guided_trials_beat_the_random_start():
    from dashboards.page import guided_sentence

    values = [0.90, 0.95, 0.80, 0.97, 0.96, 0.98]  # trials 0-2 random, 3-5 guided (one pruned)
    states = ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE", "PRUNED", "COMPLETE"]
    trials = [TrialRecord(i, s, {"lr": 0.01 * (i + 1)}, v, 1.0, None)
              for i, (s, v) in enumerate(zip(states, values, strict=True))]
    t = build_tables(StudyResult("s", "optuna", "maximize", "val_acc", trials))
    assert guided_sentence(t, PageHeader("s.yaml", random_start=3)) == (
        "The 3 trials the sampler guided reached a median val_acc of 0.97, better than the 0.9 of the 3 random "
        "trials it started with.")
    assert guided_sentence(t, PageHeader("s.yaml", random_start=0)) == ""  # random, grid...: no guided trials
    page = render_page(t, PageHeader("s.yaml", random_start=3))
    assert "The 3 trials the sampler guided reached a median val_acc of 0.97" in page
