"""What a trial's MLflow run holds, read back through MlflowClient as a user of the MLflow UI
would look for it: system metrics, dataset inputs, the confusion matrix image, git commit and
spec hash, and the best checkpoint as a logged model that ranks with the other trials'."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from sweeps.tracking.base import RunHandle
from tests.sweeps.study_helpers import cli_in_process, run_cli, write_spec


def _git_repo(folder: Path) -> str:
    """``folder`` as a committed git repository; its HEAD (what sweeps.git_commit must say)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=folder,
                              check=True, capture_output=True, text=True).stdout.strip()

    (folder / ".gitignore").write_text("runs/\n")  # the study's store and journal: not the code
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "spec")
    return git("rev-parse", "HEAD")


@pytest.mark.slow
def test_a_trial_run_holds_what_mlflow_users_look_for(tmp_path):
    import mlflow
    from mlflow import MlflowClient

    spec = write_spec(tmp_path, budget={"n_trials": 3})
    head = _git_repo(tmp_path)
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    uri = f"sqlite:///{tmp_path}/runs/mlflow.db"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags["sweeps.role"] == "study")
    trials = sorted((r for r in runs if r.data.tags["sweeps.role"] == "trial"),
                    key=lambda r: int(r.data.tags["sweeps.trial_number"]))
    assert len(trials) == 3

    digests = set()
    for run in trials:
        rid, tags = run.info.run_id, run.data.tags
        # Per-trial provenance, the same as the study's.
        assert tags["sweeps.git_commit"] == head == parent.data.tags["sweeps.git_commit"]
        assert tags["sweeps.spec_hash"] == parent.data.tags["sweeps.spec_hash"] != ""
        # MLflow's system metrics, with at least the sample taken when the trial ended.
        for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
            points = client.get_metric_history(rid, key)
            assert points and [p.step for p in points] == list(range(len(points))), key
        cpu = [p.value for p in client.get_metric_history(rid, "system/cpu_utilization_percentage")]
        assert all(0.0 <= v <= 100.0 * 64 for v in cpu)
        # Training and validation data as dataset inputs.
        inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
        assert set(inputs) == {"training", "validation"}
        assert inputs["training"].name == "digits-train" and inputs["validation"].name == "digits-val"
        assert json.loads(inputs["training"].source) == {"uri": "task:digits"}
        rows = {ctx: json.loads(d.profile)["num_rows"] for ctx, d in inputs.items()}
        assert rows == {"training": 1437, "validation": 360}  # load_digits: 1,797 images, 20% validation
        assert json.loads(inputs["validation"].profile)["shape"] == [1, 8, 8]
        digests.add((inputs["training"].digest, inputs["validation"].digest))
        # The confusion matrix as a picture beside its JSON.
        assert {a.path for a in client.list_artifacts(rid, "eval")} >= {
            "eval/confusion_matrix.json", "eval/confusion_matrix.png"}
        png = Path(client.download_artifacts(rid, "eval/confusion_matrix.png", str(tmp_path)))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert "sweeps.model_error" not in tags and "sweeps.dataset_error" not in tags
    # Same data in every trial (the split is seeded): one digest pair, two different digests.
    assert len(digests) == 1 and len(next(iter(digests))) == 2 and len(set(next(iter(digests)))) == 2

    # Every trial's best checkpoint is a logged model, ranked by the objective.
    mlflow.set_tracking_uri(uri)
    models = mlflow.search_logged_models(experiment_ids=[exp.experiment_id], output_format="list",
                                         order_by=[{"field_name": "metrics.val_acc", "ascending": False}])
    by_run = {r.info.run_id: r for r in trials}
    assert sorted(m.source_run_id for m in models) == sorted(by_run)
    ranked = [by_run[m.source_run_id].data.metrics["objective"] for m in models]
    assert ranked == sorted(ranked, reverse=True) and len(set(ranked)) == 3
    for model in models:
        run = by_run[model.source_run_id]
        assert str(model.status).endswith("READY") and model.name == f"trial-{run.data.tags['sweeps.trial_number']}"
        assert run.data.tags["sweeps.model_id"] == model.model_id
        assert model.params == {"lr": run.data.params["lr"]}
        val_acc = next(m for m in model.metrics if m.key == "val_acc")
        assert val_acc.value == pytest.approx(run.data.metrics["objective"])
        assert (val_acc.dataset_name, val_acc.dataset_digest) == ("digits-val", next(iter(digests))[1])
        # Logged with the model, not a second time into the run's curve.
        assert [p.step for p in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]
        files = [a.path for a in client.list_logged_model_artifacts(model.model_id)]
        assert files == ["checkpoint.json"]  # the weights stay in the run: not uploaded twice

    # The study's counters share no name with any trial metric (the UI charts them together).
    parent_keys = set(parent.data.metrics)
    assert parent_keys >= {"study/trials_complete", "study/best_value"}
    assert all(k.startswith("study/") for k in parent_keys)
    assert not parent_keys & {k for r in trials for k in r.data.metrics}
    assert parent.data.metrics["study/best_value"] == max(r.data.metrics["objective"] for r in trials)


@pytest.mark.slow
def test_quiet_run_on_a_server_prints_nothing_from_mlflow(tmp_path, mlflow_server):
    spec = write_spec(tmp_path, budget={"n_trials": 1}, tracking={"uri": mlflow_server.uri})
    # Processes of their own: what reaches a console is set up once per process (the handlers
    # sweeps.cli.main installs, MLflow's loggers as it is imported), and that console is the subject.
    proc = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "View run" not in out and "View experiment" not in out
    # MLflow's loggers print "<date> <LEVEL> mlflow.<module>: ..."; its URL lines start with an emoji.
    assert not re.search(r"(INFO|WARNING|ERROR|DEBUG) mlflow[.:]|🏃|🧪", out), out
    # MLflow's own switch still brings its lines back (and shows this test would see them).
    again = write_spec(tmp_path / "loud", budget={"n_trials": 1}, tracking={"uri": mlflow_server.uri}, name="loud")
    loud = run_cli(tmp_path / "loud", "run", str(again), "--quiet", MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="false")
    assert loud.returncode == 0, loud.stdout + loud.stderr
    assert "View run trial-0" in loud.stdout


def test_system_metrics_sample_a_run_until_stopped(make_tracker, store):
    from sweeps.tracking.system_metrics import SystemMetrics

    tracker = make_tracker()
    run = tracker.start_run("sys", experiment=store.experiment_name())
    metrics = SystemMetrics(tracker, run, interval=0.2).start()
    time.sleep(1.1)
    metrics.stop()
    tracker.end_run(run)
    steps = [p.step for p in store.client.get_metric_history(run.run_id, "system/cpu_utilization_percentage")]
    assert 4 <= len(steps) <= 8 and steps == list(range(len(steps)))  # ~5 samples, then the last one
    assert store.client.get_run(run.run_id).data.metrics["system/system_memory_usage_megabytes"] > 0


def test_a_store_that_is_down_keeps_the_trials_logged_model_for_later(make_tracker, tmp_path, free_port,
                                                                      fast_http_env):
    from core.results import TrainResult
    from sweeps.tracking.trial_extras import TrialExtras

    tracker = make_tracker(f"http://127.0.0.1:{free_port}", retry_interval_s=60)
    run = RunHandle("0123456789abcdef0123456789abcdef", "0", "trial-0")
    best = tmp_path / "best.pt"
    best.write_bytes(b"weights")
    extras = TrialExtras(tracker, run)
    task = _PlainTask()
    extras.watch_datasets(task)
    assert task.datasets() == ([0] * 5, [0] * 2)  # training's call: described and spooled, not sent
    assert task.datasets.__func__ is _PlainTask.datasets  # once: a second call is the task's own
    result = TrainResult("completed", "", 1, 1, {"val_acc": 0.5}, 0.5, 1, [{"epoch": 1, "step": 1, "val_acc": 0.5}],
                         checkpoint_best=best)
    extras.finish(0, {"lr": 0.1}, result)  # raises nothing
    records = [rec for _, rec in tracker.spool.read_pending(run.run_id)[0]]
    errors = {rec[1]: rec[2] for rec in records if rec[0] == "t"}
    assert "sweeps.model_error" not in errors
    models = [rec[1] for rec in records if rec[0] == "lm"]  # made once the store answers
    assert [(m["number"], m["best_epoch"], m["keys"], m["params"]) for m in models] == [(0, 1, ["val_acc"],
                                                                                        {"lr": "0.1"})]
    assert "no digest for the val dataset (list)" in errors["sweeps.dataset_error.val"]
    inputs = [rec[1] for rec in records if rec[0] == "in"]
    assert [[d["context"] for d in i] for i in inputs] == [["training", "validation"]]
    assert any(rec[0] == "m" and rec[1] == "system/cpu_utilization_percentage" for rec in records)


class _PlainTask:
    """A task whose datasets have no content to hash: logged with digest "unknown" and a tag saying why."""

    def datasets(self):
        return [0] * 5, [0] * 2

    def describe_dataset(self, dataset, split):
        return {"name": f"plain-{split}", "source": "task:plain", "digest": None, "profile": {"num_rows": len(dataset)}}


def test_a_continued_run_keeps_one_logged_model_its_latest(make_tracker, store, tmp_path):
    """A Ray trial started again logs its model again: the earlier one is deleted, not left beside it."""
    import mlflow

    from core.results import TrainResult
    from sweeps.backends.ray_continuing_run import logged_up_to
    from sweeps.tracking.reader import TrackingReader
    from sweeps.tracking.trial_extras import TrialExtras

    tracker = make_tracker()
    experiment = store.experiment_name()
    run = tracker.start_run("trial-0", experiment=experiment)
    best = tmp_path / "best.pt"
    best.write_bytes(b"weights")
    ids = []
    for start, value in enumerate((0.5, 0.75)):
        held = None  # a new run; started again, the run continues (what it holds, as a Ray trial reads it)
        if start:
            tracker.start_run(run)
            held = logged_up_to(TrackingReader(store.uri), run.run_id)
        tracker.log_metrics(run, {"val_acc": value, "lr": 0.1}, start + 1)
        history = [{"epoch": start + 1, "step": start + 1, "val_acc": value, "lr": 0.1}]
        result = TrainResult("completed", "", start + 1, start + 1, history[-1], value, start + 1, history,
                             checkpoint_best=best)
        TrialExtras(tracker, run, held).finish(0, {"lr": 0.1}, result)
        tracker.flush(run)
        ids.append(store.client.get_run(run.run_id).data.tags["sweeps.model_id"])
    mlflow.set_tracking_uri(store.uri)
    models = mlflow.search_logged_models(experiment_ids=[run.experiment_id], output_format="list")
    assert [m.model_id for m in models] == [ids[1]] and ids[0] != ids[1]
    assert [(m.key, m.value, m.step) for m in models[0].metrics] == [("val_acc", 0.75, 2)]  # lr is not the model's
    assert [p.step for p in store.client.get_metric_history(run.run_id, "val_acc")] == [1, 2]
    # Its system metrics go on from the first start's steps, not again from 0.
    steps = [p.step for p in store.client.get_metric_history(run.run_id, "system/cpu_utilization_percentage")]
    assert steps == [0, 1]


@pytest.mark.parametrize("status", ["pruned", "diverged"])
def test_a_pruned_trial_logs_no_model_to_the_models_tab(make_tracker, store, tmp_path, status):
    """Promote never picks a pruned trial: its checkpoint stays in its run, and the Models tab
    lists only completed trials' models."""
    import mlflow

    from core.results import TrainResult
    from sweeps.tracking.trial_extras import TrialExtras

    tracker = make_tracker()
    experiment = store.experiment_name()
    best = tmp_path / "best.pt"
    best.write_bytes(b"weights")
    for number, state in enumerate((status, "completed")):
        run = tracker.start_run(f"trial-{number}", experiment=experiment)
        tracker.log_metrics(run, {"val_acc": 0.5}, 1)
        history = [{"epoch": 1, "step": 1, "val_acc": 0.5}]
        result = TrainResult(state, "", 1, 1, history[-1], 0.5, 1, history, checkpoint_best=best)
        TrialExtras(tracker, run).finish(number, {"lr": 0.1}, result)
        tracker.flush(run)
    mlflow.set_tracking_uri(store.uri)
    models = mlflow.search_logged_models(experiment_ids=[run.experiment_id], output_format="list")
    assert [m.name for m in models] == ["trial-1"]
