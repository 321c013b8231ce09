"""`sweeps rerun` on a real finished study: rebuilt from the run's resolved config, trained
again, every curve compared with the original's."""
from __future__ import annotations

import re
import statistics

import pytest

from sweeps import cli
from tests.sweeps.study_fixtures import finished_study, in_study  # noqa: F401

pytestmark = pytest.mark.slow


def _threads(run) -> str:
    """The CPU thread count the trial ran on, from its device tag ("cpu (4 threads)")."""
    return re.match(r"cpu \((\d+) threads?\)", run.data.tags["sweeps.device"]).group(1)


def _reruns_of(client, experiment_id: str, run_id: str, role: str = "rerun") -> list:
    return client.search_runs([experiment_id], f"tags.`rerun_of` = '{run_id}' and tags.`sweeps.role` = '{role}'",
                              order_by=["attributes.start_time DESC"])


def test_rerun_with_the_original_seed_is_bitwise_identical(in_study, capsys):
    client = in_study.client()
    original = in_study.trial_runs()[0]

    # bit for bit needs the original's CPU thread count (a rerun uses this process's unless told)
    assert cli.main(["rerun", str(in_study.spec), "--trial", "0", "--threads", _threads(original)]) == 0
    out = capsys.readouterr().out
    assert "verdict (seed 0" in out and "identical" in out and "bitwise equal" in out
    assert "warning: this rerun trains on" not in out

    [rerun] = _reruns_of(client, original.info.experiment_id, original.info.run_id)
    tags = rerun.data.tags
    assert tags["sweeps.rerun.verdict"] == "identical"
    assert tags["mlflow.parentRunId"] == original.data.tags["mlflow.parentRunId"]  # nested under the study
    assert tags["sweeps.trial_number"] == "0" and tags["sweeps.seed"] == "0"
    assert rerun.info.status == "FINISHED"
    assert rerun.data.params["lr"] == original.data.params["lr"]
    # the comparison really covered the per-step and per-epoch curves
    steps = client.get_metric_history(rerun.info.run_id, "step/train_loss")
    assert len(steps) > 10
    assert [m.value for m in steps] == [m.value for m in client.get_metric_history(original.info.run_id,
                                                                                   "step/train_loss")]
    assert int(tags["sweeps.rerun.metrics_compared"]) >= 9


def test_rerun_with_another_seed_says_where_the_curves_part(in_study, monkeypatch, capsys):
    client = in_study.client()
    original = in_study.trial_runs()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", in_study.uri)  # no spec: the run id and the store are enough

    assert cli.main(["rerun", "--run-id", original.info.run_id, "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "differs: largest absolute difference" in out and "the curves part first at step 1" in out

    [rerun] = _reruns_of(client, original.info.experiment_id, original.info.run_id)
    tags = rerun.data.tags
    assert tags["sweeps.rerun.verdict"] == "differs" and tags["sweeps.seed"] == "1"
    assert tags["sweeps.rerun.first_diff_step"] == "1"  # a new seed changes the init: the first step differs
    assert tags["sweeps.rerun.first_diff_metric"].startswith("step/")
    assert float(tags["sweeps.rerun.max_abs_diff"]) > 0
    assert tags["sweeps.rerun.max_diff_metric"] in rerun.data.metrics


def test_rerun_over_seeds_logs_mean_and_std(in_study, capsys):
    client = in_study.client()
    original = in_study.trial_runs()[2]

    assert cli.main(["rerun", str(in_study.spec), "--trial", "2", "--seeds", "0,1", "--threads",
                     _threads(original)]) == 0
    out = capsys.readouterr().out
    assert "val_acc: mean" in out and "std" in out
    # Seed 0 is the original's: a reproduction, judged; seed 1 trains another model, not "differs".
    assert "verdict (seed 0" in out and "verdict (seed 1" not in out
    assert re.search(r"seed 1: val_acc [0-9.]+ \(run [0-9a-f]{32}\); the original trained with seed 0", out)

    [seeds_run] = _reruns_of(client, original.info.experiment_id, original.info.run_id, role="seeds")
    reruns = {r.data.tags["sweeps.seed"]: r for r in _reruns_of(client, original.info.experiment_id,
                                                                original.info.run_id)}
    assert set(reruns) == {"0", "1"}
    assert all(r.data.tags["mlflow.parentRunId"] == seeds_run.info.run_id for r in reruns.values())
    assert reruns["0"].data.tags["sweeps.rerun.verdict"] == "identical"
    values = [reruns[s].data.metrics["objective"] for s in ("0", "1")]
    assert values[0] == original.data.metrics["objective"]
    metrics = seeds_run.data.metrics
    assert metrics["objective_mean"] == pytest.approx(statistics.fmean(values))
    assert metrics["objective_std"] == pytest.approx(statistics.stdev(values))
    assert seeds_run.data.params["seeds"] == "0,1"
    per_seed = client.get_metric_history(seeds_run.info.run_id, "objective")
    assert sorted((m.step, m.value) for m in per_seed) == [(0, values[0]), (1, values[1])]


def test_rerun_needs_a_spec_for_a_trial_number_and_an_existing_run(in_study, capsys):
    assert cli.main(["rerun", "--trial", "0"]) == 2
    assert "needs the study spec" in capsys.readouterr().err
    assert cli.main(["rerun", str(in_study.spec), "--trial", "99"]) == 2
    assert "no MLflow run for trial 99" in capsys.readouterr().err
    assert cli.main(["rerun", "--run-id", "0" * 32, "--tracking-uri", in_study.uri]) == 2
    assert "not found" in capsys.readouterr().err


def test_rerun_of_a_run_without_curves_says_nothing_to_compare_and_fails(in_study, capsys, tmp_path):
    client = in_study.client()
    original = in_study.trial_runs()[0]
    # A trial run as one retried from its final checkpoint used to end: its config and final
    # numbers, no per-epoch or per-step curve. In an experiment of its own: not one of the study's trials.
    exp = client.create_experiment(f"no-curves-{original.info.run_id[:8]}")
    bare = client.create_run(exp, tags={"sweeps.device": original.data.tags["sweeps.device"],
                                        "sweeps.trial_number": "0"}).info.run_id
    config = client.download_artifacts(original.info.run_id, "config/resolved_config.json", str(tmp_path))
    client.log_artifact(bare, config, "config")
    client.log_metric(bare, "objective", original.data.metrics["objective"], step=0)
    client.set_terminated(bare)

    assert cli.main(["rerun", "--run-id", bare, "--tracking-uri", in_study.uri]) == 1
    out = capsys.readouterr().out
    assert f"nothing to compare: the original run {bare} has no per-epoch or per-step metric curve (only " \
           f"objective)" in out
    assert "identical" not in out
    [rerun] = _reruns_of(client, exp, bare)
    assert rerun.data.tags["sweeps.rerun.verdict"] == "nothing to compare"


def test_rerun_prints_each_epoch_and_trains_on_the_threads_asked(in_study, capsys):
    client = in_study.client()
    original = in_study.trial_runs()[1]
    then = int(_threads(original))
    threads = then + 1  # another count than the original's: the rerun must say what that means

    assert cli.main(["rerun", str(in_study.spec), "--trial", "1", "--threads", str(threads)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]  # one line per epoch, as it trains
    for line in lines:
        assert re.search(r"val_acc=[0-9.]+ .*train_loss=[0-9.]+ .*val_loss=[0-9.]+ .*elapsed [0-9.]+s$", line), line
    assert f"{threads} CPU threads" in out
    assert (f"warning: this rerun trains on {threads} CPU threads, the original on {then}" in out
            and f"rerun with --threads {then} for a bitwise reproduction" in out)
    assert out.index("warning: this rerun trains on") < out.index("epoch 1/3")  # said before training

    rerun = _reruns_of(client, original.info.experiment_id, original.info.run_id)[0]  # the newest
    tags = rerun.data.tags
    assert tags["sweeps.rerun.threads"] == str(threads) and tags["sweeps.rerun.original_threads"] == str(then)
    assert tags["sweeps.device"] == f"cpu ({threads} threads)"


def test_rerun_refuses_a_thread_count_below_one(in_study, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["rerun", str(in_study.spec), "--trial", "1", "--threads", "0"])
    assert exc.value.code == 2
    assert "'0' is not a positive whole number of threads" in capsys.readouterr().err
