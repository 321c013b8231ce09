"""`sweeps compare` and the curve comparison behind `sweeps rerun`."""
from __future__ import annotations

import math
import uuid

import pytest

from sweeps import cli
from sweeps.compare import compare_curves, compare_table
from sweeps.tracking import TrackingReader
from tests.sweeps.study_fixtures import finished_study, in_study  # noqa: F401


def _row(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if f" {key} " in line)


@pytest.mark.slow
def test_compare_prints_both_runs_params_with_the_differences_marked(in_study, capsys):
    runs = in_study.trial_runs()
    a, b = runs[0], runs[1]

    assert cli.main(["compare", a.info.run_id, b.info.run_id, "--tracking-uri", in_study.uri]) == 0
    out = capsys.readouterr().out
    lr_row = _row(out, "lr")
    assert lr_row.lstrip("│┃ ").startswith("*")  # marked
    assert a.data.params["lr"] in lr_row and b.data.params["lr"] in lr_row
    epochs_row = _row(out, "epochs")
    assert "*" not in epochs_row and epochs_row.count("3") >= 2  # equal: both shown, not marked
    assert "val_acc" in out and "rows marked * differ" in out
    assert "params differ: lr" in out

    table, n_diff = compare_table(a, b)
    assert n_diff >= 3  # lr twice, trial number, run name, metrics


@pytest.mark.slow
def test_compare_uses_mlflow_tracking_uri_and_names_a_missing_run(in_study, monkeypatch, capsys):
    runs = in_study.trial_runs()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", in_study.uri)
    assert cli.main(["compare", runs[0].info.run_id, runs[0].info.run_id]) == 0
    assert "0 of" in capsys.readouterr().out
    assert cli.main(["compare", runs[0].info.run_id, "f" * 32]) == 2
    assert "not found" in capsys.readouterr().err


def test_compare_refuses_a_missing_local_store_instead_of_creating_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli.main(["compare", "a" * 32, "b" * 32]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_curve_comparison_finds_the_first_parting_step_and_the_largest_difference(in_study):
    client = in_study.client()
    reader = TrackingReader(in_study.uri, client)
    exp = client.create_experiment(f"curves-{uuid.uuid4().hex[:8]}")
    a, b = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    for step in range(1, 6):
        client.log_metric(a, "step/train_loss", 1.0 / step, step=step)
        client.log_metric(b, "step/train_loss", 1.0 / step + (0.5 if step >= 3 else 0.0), step=step)
        client.log_metric(a, "val_loss", float("nan") if step == 2 else 2.0, step=step)
        client.log_metric(b, "val_loss", float("nan") if step == 2 else 2.0, step=step)  # NaN matches NaN
        client.log_metric(a, "epoch_time_s", step, step=step)  # timing: never compared
        client.log_metric(b, "epoch_time_s", 2 * step, step=step)
    client.log_metric(a, "val_acc", 0.5, step=1)
    client.log_metric(a, "val_acc", 0.6, step=2)
    client.log_metric(b, "val_acc", 0.5, step=1)  # b lacks a point of a

    result = compare_curves(reader, a, a)
    assert result.identical and result.verdict().startswith("identical")

    result = compare_curves(reader, a, b)
    assert not result.identical
    assert {m.name for m in result.metrics} == {"step/train_loss", "val_loss", "val_acc"}
    first, worst = result.first_parting(), result.largest()
    assert (first.name, first.first_step) == ("step/train_loss", 3)
    assert worst.name == "step/train_loss" and math.isclose(worst.max_abs_diff, 0.5)
    assert next(m for m in result.metrics if m.name == "val_loss").identical
    assert next(m for m in result.metrics if m.name == "val_acc").missing_steps == [2]
    tags = result.tags()
    assert tags["sweeps.rerun.verdict"] == "differs" and tags["sweeps.rerun.first_diff_step"] == 3
    assert "val_acc" in result.verdict()
    # extra points in the rerun (it trained on past a pruned original) are not a difference
    assert compare_curves(reader, b, a).metrics[0].name == "step/train_loss"
    assert next(m for m in compare_curves(reader, b, a).metrics if m.name == "val_acc").identical


@pytest.mark.slow
def test_a_comparison_without_a_curve_in_both_runs_says_there_is_nothing_to_compare(in_study):
    client = in_study.client()
    reader = TrackingReader(in_study.uri, client)
    exp = client.create_experiment(f"nothing-{uuid.uuid4().hex[:8]}")
    a, b, c = (client.create_run(exp).info.run_id for _ in range(3))
    for run in (a, b):  # what a trial retried from its final checkpoint used to log: final numbers only
        client.log_metric(run, "objective", 0.9, step=0)
        client.log_metric(run, "trial_seconds", 1.0, step=0)
    client.log_metric(c, "objective", 0.9, step=0)
    client.log_metric(c, "val_acc", 0.9, step=1)

    result = compare_curves(reader, a, b)
    assert [m.name for m in result.metrics] == ["objective"] and result.metrics[0].identical
    assert result.nothing_to_compare and not result.identical
    assert result.verdict() == f"nothing to compare: the original run {a} has no per-epoch or per-step metric " \
                               f"curve (only objective)"
    assert result.tags()["sweeps.rerun.verdict"] == "nothing to compare"

    result = compare_curves(reader, c, a)  # the original has a curve, the other run lacks it
    assert result.nothing_to_compare and not result.identical
    assert result.verdict() == f"nothing to compare: run {a} has none of the original's curves (val_acc)"
    assert compare_curves(reader, c, c).identical


# ---- addressing runs: trial numbers, prefixes, what `sweeps status` shows -----------------------
@pytest.mark.slow
def test_compare_takes_trial_numbers_with_the_spec(in_study, capsys):
    runs = in_study.trial_runs()

    assert cli.main(["compare", str(in_study.spec), "0", "2"]) == 0
    out = capsys.readouterr().out
    assert f"compare {runs[0].info.run_id} vs {runs[2].info.run_id}" in out
    assert "params differ: lr" in out

    assert cli.main(["compare", str(in_study.spec), "0", "9"]) == 2
    assert "no MLflow run for trial 9; trials with runs: [0, 1, 2]" in capsys.readouterr().err
    assert cli.main(["compare", "0", "2"]) == 2  # a trial number needs the spec: it says so
    assert "trial numbers need the study spec first (sweeps compare SPEC 0 N)" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_takes_run_id_prefixes_as_status_shows_them(in_study, capsys):
    runs = in_study.trial_runs()
    a, b = runs[1].info.run_id, runs[2].info.run_id
    # `sweeps status` at 80 columns cuts the id to 19 characters and an ellipsis: pasted as it is
    assert cli.main(["status", str(in_study.spec)]) == 0
    status = capsys.readouterr().out

    spec = str(in_study.spec)
    for args in ([a[:8], b[:12]], [a[:19] + "\u2026", b], [spec, a.upper()[:10], "2"]):  # prefix and trial mixed
        assert cli.main(["compare", *args]) == 0, args
        assert f"compare {a} vs {b}" in capsys.readouterr().out
    shown = next(line for line in status.splitlines() if a[:8] in line)  # what the table really holds
    cell = next(word for word in shown.replace("\u2502", " ").split() if word.startswith(a[:8]))
    assert cli.main(["compare", cell, b]) == 0 and f"compare {a} vs {b}" in capsys.readouterr().out


def _store_with_colliding_prefix(tmp_path):
    """A real SQLite store with runs until two ids share their first character, a letter."""
    import shutil

    from mlflow.tracking import MlflowClient

    from tests.sweeps.study_helpers import empty_mlflow_db

    shutil.copyfile(empty_mlflow_db(), tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("prefixes", artifact_location=str(tmp_path / "mlartifacts" / "prefixes"))
    by_first: dict[str, list[str]] = {}
    while not any(len(ids) > 1 for ch, ids in by_first.items() if ch.isalpha()):
        run_id = client.create_run(exp).info.run_id
        by_first.setdefault(run_id[0], []).append(run_id)
    first = next(ch for ch, ids in by_first.items() if ch.isalpha() and len(ids) > 1)
    return uri, first, by_first


def test_an_ambiguous_run_id_prefix_lists_the_candidates(tmp_path, capsys):
    uri, first, by_first = _store_with_colliding_prefix(tmp_path)
    other = next(ids[0] for ch, ids in by_first.items() if ch != first)

    assert cli.main(["compare", first, other, "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert f"run id prefix {first!r} is ambiguous: {len(by_first[first])} runs" in err
    assert all(run_id in err for run_id in by_first[first]) and "give more characters" in err

    taken = {run_id[:2] for ids in by_first.values() for run_id in ids}
    unknown = next(p for p in (a + b for a in "abcdef" for b in "abcdef") if p not in taken)
    assert cli.main(["compare", unknown, other, "--tracking-uri", uri]) == 2
    assert f"no MLflow run id starts with {unknown!r}" in capsys.readouterr().err
    assert cli.main(["compare", "not-an-id", other, "--tracking-uri", uri]) == 2
    assert "'not-an-id' is not a run id" in capsys.readouterr().err
    assert cli.main(["compare", other, "--tracking-uri", uri]) == 2
    assert "compare takes two runs" in capsys.readouterr().err


def _run(run_id: str, name: str, params: dict[str, str], val_acc: float):
    from mlflow.entities import Metric, Param, Run, RunData, RunInfo

    info = RunInfo(run_id, "1", "u", "FINISHED", 0, 1, "active", run_name=name)
    data = RunData(metrics=[Metric("val_acc", val_acc, 0, 1)], params=[Param(k, v) for k, v in params.items()])
    return Run(info, data)


def test_compare_diff_shows_only_the_rows_that_differ():
    from rich.console import Console

    fixed = {"epochs": "3", "optimizer": "sgd", "scheduler": "onecycle", "seed": "0", "task": "digits"}
    a = _run("a" * 32, "trial-0", {**fixed, "lr": "0.01"}, 0.95)
    b = _run("b" * 32, "trial-1", {**fixed, "lr": "0.1"}, 0.97)
    console = Console(width=200, record=True)
    console.print(compare_table(a, b, only_differences=True)[0])
    shown = console.export_text()
    assert "lr" in shown and "val_acc" in shown and "trial-0" in shown
    assert not any(f" {k} " in shown for k in fixed)  # equal rows left out
    console.print(compare_table(a, b)[0])
    full = console.export_text()
    assert all(f" {k} " in full for k in fixed)  # and shown without --diff


def test_compare_with_a_spec_and_one_trial_says_a_second_is_missing(capsys):
    assert cli.main(["compare", "studies/lr_bs.yaml", "3"]) == 2
    err = capsys.readouterr().err
    assert "two trials to compare follow the spec, e.g. sweeps compare studies/lr_bs.yaml 3 7" in err
    assert "is not a run id" not in err
