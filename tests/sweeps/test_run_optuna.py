"""`sweeps run` on Optuna end to end: real workers, real MLflow store, real journal storage.

The first study and the signal tests run the CLI in a process of its own, as a user does; the
others run its main in this process (:func:`cli_in_process`): what they check (the study's
records, the messages, the exit code) does not depend on the driver's own process, and each
study's trials still run in real worker processes."""
from __future__ import annotations

import os
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.sweeps.study_helpers import (
    cli_in_process,
    load_study,
    mlflow_runs,
    run_cli,
    start_cli,
    sweeps_env,
    write_spec,
)

pytestmark = pytest.mark.slow

def _readback(cwd, experiment):
    """Every run of the experiment as the store holds it once the run's process has ended."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd}/runs/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    out = []
    for r in client.search_runs([exp.experiment_id], max_results=1000):
        arts = [a.path for a in client.list_artifacts(r.info.run_id)]
        for top in list(arts):
            arts += [a.path for a in client.list_artifacts(r.info.run_id, top)]
        out.append({"id": r.info.run_id, "status": r.info.status, "tags": r.data.tags, "params": r.data.params,
                    "metrics": sorted(r.data.metrics), "metric_values": r.data.metrics,
                    "val_acc_steps": [m.step for m in client.get_metric_history(r.info.run_id, "val_acc")],
                    "train_loss_steps": len(client.get_metric_history(r.info.run_id, "step/train_loss")),
                    "artifacts": arts})
    return out


def test_four_trials_make_one_parent_and_four_nested_children(tmp_path):
    spec = write_spec(tmp_path, train={"export_onnx": True})
    proc = run_cli(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "promote it:" in proc.stdout and "sweeps rerun" in proc.stdout

    runs = _readback(tmp_path, "tiny")  # read back after the run's process ended
    parents = [r for r in runs if r["tags"].get("sweeps.role") == "study"]
    children = [r for r in runs if r["tags"].get("sweeps.role") == "trial"]
    assert len(parents) == 1 and len(children) == 4
    parent = parents[0]
    assert "spec/tiny.yaml" in parent["artifacts"] and "summary/summary.json" in parent["artifacts"]
    assert parent["tags"]["sweeps.best_trial"] in {c["tags"]["sweeps.trial_number"] for c in children}
    # The counts sweeps run kept current while trials ran end with none running.
    assert {k: v for k, v in parent["metric_values"].items() if k.startswith("study/trials_")} == {
        "study/trials_complete": 4.0, "study/trials_pruned": 0.0, "study/trials_fail": 0.0,
        "study/trials_running": 0.0, "study/trials_waiting": 0.0}
    for child in children:
        assert child["tags"]["mlflow.parentRunId"] == parent["id"]
        assert child["status"] == "FINISHED" and child["tags"]["sweeps.state"] == "COMPLETE"
        assert child["val_acc_steps"] == [1, 2]
        assert child["train_loss_steps"] == 2 * 12  # 1,437 training images / batch 128 = 12 steps per epoch
        assert not any(k.startswith(("train.", "search.")) for k in child["params"])  # searched: own names
        assert {"lr", "epochs", "optimizer", "scheduler", "seed", "task"} <= set(child["params"])
        for art in ("config/resolved_config.json", "checkpoints/best.pt", "onnx/model.onnx",
                    "onnx/onnx_parity.json", "eval/confusion_matrix.json"):
            assert art in child["artifacts"], (art, child["artifacts"])
        assert child["tags"]["sweeps.onnx_parity_passed"] == "true"
    assert sorted(int(c["tags"]["sweeps.trial_number"]) for c in children) == [0, 1, 2, 3]

    # The storage is a plain Optuna journal: optuna.load_study opens it.
    study = load_study(tmp_path, "tiny")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
    assert study.best_value == max(t.value for t in study.trials)

    # Running the same command again resumes: the budget is a total, so nothing more runs.
    again = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert again.returncode == 0, again.stderr
    assert "nothing to run: all 4 trials of budget.n_trials have run" in again.stdout
    assert len(load_study(tmp_path, "tiny").trials) == 4
    assert len([r for r in mlflow_runs(tmp_path, "tiny") if r.data.tags.get("sweeps.role") == "study"]) == 1

    status = cli_in_process(tmp_path, "status", str(spec))
    assert status.returncode == 0 and "COMPLETE" in status.stdout and "*" in status.stdout


def test_pruned_trials_are_pruned_in_optuna_and_killed_in_mlflow(tmp_path):
    # Two good learning rates first (startup trials), then hopeless ones the median pruner stops.
    spec = write_spec(tmp_path, name="prune", train={"epochs": 4},
                      search={"lr": {"type": "categorical", "choices": [0.3, 1.0e-6]}},
                      sampler={"name": "grid", "seed": 0}, pruner={"name": "median", "warmup_epochs": 0},
                      budget={"n_trials": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stderr
    # Grow the study: enqueue more hopeless and good trials in a second invocation.
    spec = write_spec(tmp_path, name="prune", train={"epochs": 4},
                      search={"lr": {"type": "categorical", "choices": [0.3, 1.0e-6]}},
                      sampler={"name": "random", "seed": 1}, pruner={"name": "median", "warmup_epochs": 0},
                      budget={"n_trials": 8})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stderr
    study = load_study(tmp_path, "prune")
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert pruned, [(t.params, t.state.name) for t in study.trials]
    assert all(t.params["lr"] == 1.0e-6 for t in pruned)
    runs = {r.data.tags["sweeps.trial_number"]: r for r in mlflow_runs(tmp_path, "prune")
            if r.data.tags.get("sweeps.role") == "trial"}
    for t in pruned:
        run = runs[str(t.number)]
        assert run.info.status == "FINISHED" and run.data.tags["sweeps.pruned"] == "true"
        assert "pruned after epoch" in run.data.tags["sweeps.reason"]


def test_two_cpu_workers_run_trials_at_the_same_time_without_lock_errors(tmp_path):
    spec = write_spec(tmp_path, name="par", train={"epochs": 6, "batch_size": 32},
                      budget={"n_trials": 4}, resources={"devices": "cpu", "workers": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "locked" not in out.lower() and "Traceback" not in out
    assert "RuntimeWarning" not in out  # each worker forked from the fork server starts silently
    study = load_study(tmp_path, "par")
    trials = study.trials
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # both workers ran trials
    overlaps = [(a.number, b.number) for a in trials for b in trials if a.number < b.number
                and a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete]
    assert overlaps, "no two trials ran at the same time"


def test_unreachable_tracking_server_fails_before_training(tmp_path, free_port):
    spec = write_spec(tmp_path, name="nosrv", tracking={"uri": f"http://127.0.0.1:{free_port}"})
    proc = cli_in_process(tmp_path, "run", str(spec))
    assert proc.returncode != 0
    assert f"127.0.0.1:{free_port}" in proc.stderr and "mlflow server" in proc.stderr  # the URI and the fix
    assert not (tmp_path / "runs" / "nosrv.journal").exists()
    # No worker was started before the check, and nothing was left behind.
    assert not (tmp_path / "runs" / "nosrv").exists()
    assert not _workers_in(tmp_path)


class _Forbidden(BaseHTTPRequestHandler):
    """A server that answers every request with 403 (a proxy or an MLflow that needs a signed-in user)."""

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.send_response(403)
        self.end_headers()

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args):
        pass


def test_a_403_to_a_run_that_sent_no_credentials_says_to_set_them(tmp_path, free_port):
    server = HTTPServer(("127.0.0.1", free_port), _Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = write_spec(tmp_path, name="forbidden", tracking={"uri": f"http://127.0.0.1:{free_port}"})
        proc = cli_in_process(tmp_path, "run", str(spec), MLFLOW_TRACKING_USERNAME="", MLFLOW_TRACKING_TOKEN="")
    finally:
        server.shutdown()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "HTTP 403" in proc.stderr and "no credentials were sent" in proc.stderr, proc.stderr
    assert "signed in" not in proc.stderr  # it was said of a token nobody set
    assert not (tmp_path / "runs" / "forbidden").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_tracking_server_keeps_silent_stops_the_run_at_once(tmp_path, free_port, signum):
    """A server that takes the connection and never answers holds the store's check for its 30 s
    read timeout; Ctrl-C or SIGTERM there stops the run at once, 128 + n, no study created."""
    with socket.create_server(("127.0.0.1", free_port)) as server:
        spec = write_spec(tmp_path, name="silent", tracking={"uri": f"http://127.0.0.1:{free_port}"})
        proc = start_cli(tmp_path, "run", str(spec))
        try:
            server.settimeout(120)
            conn, _ = server.accept()  # the check has connected: it now waits for an answer
            with conn:
                proc.send_signal(signum)
                out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 128 + signum, out
    assert f"stopped by {signum.name} while waiting for the MLflow tracking server" in out, out
    assert "Traceback" not in out and "timed out" not in out, out
    assert not (tmp_path / "runs" / "silent").exists() and not (tmp_path / "runs" / "silent.journal").exists()


def _workers_in(folder: Path) -> list[str]:
    """Command lines of worker processes (or their fork server) running in ``folder``."""
    lines = []
    for proc in Path("/proc").iterdir():
        try:
            line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if ("optuna_worker" in line or "worker_forkserver" in line) and Path(os.readlink(proc / "cwd")) == folder:
                lines.append(line)
        except (OSError, ValueError):
            continue  # not a process folder, or it ended meanwhile
    return lines


def test_changed_search_space_is_refused_unless_fresh(tmp_path):
    spec = write_spec(tmp_path, name="chg", budget={"n_trials": 1})
    assert cli_in_process(tmp_path, "run", str(spec), "--quiet").returncode == 0
    spec = write_spec(tmp_path, name="chg", budget={"n_trials": 1},
                      search={"lr": {"type": "float", "low": 0.001, "high": 0.5, "log": True}})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 2 and "lr" in proc.stderr and "--fresh" in proc.stderr
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", "--fresh")
    assert proc.returncode == 0, proc.stderr
    import optuna

    names = sorted(s.study_name for s in optuna.get_all_study_summaries(load_study(tmp_path, "chg")._storage))
    assert names == ["chg", "chg-v2"]  # the old study is kept


def test_max_failures_in_a_row_stops_the_study(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver (this process) checks the target; workers get PYTHONPATH
    (tmp_path / "broken_task.py").write_text(
        "from core.tasks import task\n"
        "from core.tasks.digits import DigitsTask\n"
        "class Broken(DigitsTask):\n"
        "    def datasets(self):\n"
        "        raise RuntimeError('data folder is empty')\n"
        "@task\n"
        "def make_task(model='mlp'):\n"
        "    return Broken(model)\n")
    spec = write_spec(tmp_path, name="broken", task={"name": None, "target": "broken_task:make_task", "model": "mlp",
                                                     "args": {}}, budget={"n_trials": 6, "max_failures": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", PYTHONPATH=f"{tmp_path}:{sweeps_env()['PYTHONPATH']}")
    assert proc.returncode == 1
    assert "failed in a row" in proc.stdout + proc.stderr
    study = load_study(tmp_path, "broken")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    assert "RuntimeError: data folder is empty" in study.trials[0].user_attrs["fail_reason"]
    runs = [r for r in mlflow_runs(tmp_path, "broken") if r.data.tags.get("sweeps.role") == "trial"]
    assert all(r.info.status == "FAILED" and "data folder is empty" in r.data.tags["sweeps.error"] for r in runs)


def test_study_level_lr_finder_narrows_the_lr_range(tmp_path):
    spec = write_spec(tmp_path, name="lrf", budget={"n_trials": 2},
                      search={"lr": {"type": "float", "low": 1.0e-4, "high": 1.0, "log": True}},
                      lr_finder={"enabled": True, "narrow_search": True, "narrow_factor": 3.0})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stderr
    study = load_study(tmp_path, "lrf")
    summary = study.user_attrs["lr_finder"]
    low, high = summary["narrowed"]
    assert low == pytest.approx(max(1e-4, summary["suggestion"] / 3)) and high == pytest.approx(
        min(1.0, summary["suggestion"] * 3))
    assert all(low <= t.params["lr"] <= high for t in study.trials)
    parent = [r for r in mlflow_runs(tmp_path, "lrf") if r.data.tags.get("sweeps.role") == "study"][0]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "lr_finder")] == ["lr_finder/lr_finder.json"]
