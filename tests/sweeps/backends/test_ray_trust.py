"""Pieces of the Ray backend's trust (issue 30) that the shared contract suite
(test_backend_contract.py, which runs the whole-study cases on both backends) does not show
alone: a continued run logs no step twice, the hang watchdog records its reason before it
kills, a driver stopped by SIGTERM leaves no process behind, and a study name reused after its
Ray folder was deleted never touches the old study's runs or folders."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.sweeps.backends.conftest import mlflow_client, run_cli, study_runs, write_spec
from tests.sweeps.study_helpers import ROOT

pytestmark = pytest.mark.ray


def _ray_spec(tmp_path, name, **overrides):
    return write_spec(tmp_path, name=name, backend="ray", **overrides)


# ---- pieces ---------------------------------------------------------------------------------------
def test_a_continued_run_logs_no_step_it_already_holds(tmp_path, monkeypatch):
    """A trial resumed from a checkpoint older than what its run holds trains those steps
    again: the continued run keeps one point per step and takes the new ones after it."""
    from sweeps.backends.ray_continuing_run import logged_up_to
    from sweeps.parent_run import find_or_create_parent, reader_for, tracker_for
    from sweeps.spec.load import load_spec
    from sweeps.trial import TrialSpec, start_trial_run
    from sweeps.trial_control import TrialControl
    from sweeps.trial_reporter import TrialReporter

    monkeypatch.chdir(tmp_path)
    spec = load_spec(_ray_spec(tmp_path, "steps"))
    tracker = tracker_for(spec)
    parent = find_or_create_parent(tracker, spec, spec.name, "ray")
    trial = TrialSpec(0, {"lr": 0.1}, tmp_path / "trial-0000", parent, "ray")
    run = start_trial_run(spec, tracker, trial)
    first = TrialReporter(tracker, run, "val_acc", TrialControl())
    for step in range(1, 8):  # killed mid-epoch 2: the checkpoint holds epoch 1 (steps 1-4)
        first.report_step(step, {"train_loss": 1.0 / step})
    first.report_epoch(1, 4, {"val_acc": 0.5})
    tracker.end_run(run, "KILLED")

    held = logged_up_to(reader_for(spec), run.run_id)
    start_trial_run(spec, tracker, TrialSpec(0, {"lr": 0.1}, trial.out_dir, parent, "ray", continues=run,
                                             logged_up_to=held))
    again = TrialReporter(tracker, run, "val_acc", TrialControl(), held)
    for step in range(5, 11):  # the retry trains steps 5-10 from the epoch-1 checkpoint
        again.report_step(step, {"train_loss": 2.0 / step})
    again.report_epoch(2, 10, {"val_acc": 0.6})
    tracker.end_run(run, "FINISHED")

    client = mlflow_client(tmp_path)
    losses = {m.step: m.value for m in client.get_metric_history(run.run_id, "step/train_loss")}
    assert len(client.get_metric_history(run.run_id, "step/train_loss")) == len(losses) == 10
    assert losses[7] == pytest.approx(1.0 / 7) and losses[8] == pytest.approx(2.0 / 8)
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "val_acc")) == [1, 2]


def test_the_hang_watchdog_records_the_reason_then_kills_its_process(tmp_path):
    """In a real process that hangs: the reason is recorded first, then SIGKILL."""
    reason_file = tmp_path / "reason.txt"
    code = textwrap.dedent(f"""
        import threading
        from sweeps.backends.ray_hang import HangWatchdog
        def on_hung(reason):
            open({str(reason_file)!r}, "w").write(reason)
        watchdog = HangWatchdog(0.5, "500ms", on_hung).start()
        watchdog.beat()
        threading.Event().wait()  # hangs: no beat ever again
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert reason_file.read_text().startswith("hung: no progress for 0 s (budget.trial_timeout=500ms)") or \
        reason_file.read_text().startswith("hung: no progress for 1 s (budget.trial_timeout=500ms)")


# ---- whole studies --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_driver_stopped_by_sigterm_leaves_no_process_behind_then_its_name_reused_is_a_new_study(
        tmp_path, ray_tmp):
    """Under a reaping parent (a child subreaper, as an init would be), the driver stopped by
    SIGTERM mid-trial hands it nothing: its Ray processes have ended and been reaped by the
    driver, none left as a zombie for a pid 1 that does not reap. (A SIGKILLed driver cannot
    reap: the processes its guardian kills go to pid 1, which must reap them: compose's
    services run with `init: true`.)

    Then runs/ray/<study> is deleted and the same spec run again: a new study, with a new parent
    run and new trial runs; the old trial folder's files are moved aside, not overwritten."""
    import json
    import shutil

    from core.faults import Fault
    from tests.sweeps.study_helpers import sweeps_env

    spec_path = _ray_spec(tmp_path, "reaped", train={"epochs": 3, "batch_size": 16}, budget={"n_trials": 1},
                          resources={"devices": "cpu", "workers": 1})
    wrapper = [sys.executable, str(ROOT / "tests" / "sweeps" / "backends" / "under_subreaper.py"),
               sys.executable, "-m", "sweeps.cli", "run", str(spec_path), "--quiet"]
    env = sweeps_env(OMP_NUM_THREADS="1", SWEEPS_FAULT=Fault.DRIVER_SIGTERM_MID_TRIAL.value)
    proc = subprocess.run(wrapper, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 128 + signal.SIGTERM, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["left"] == [], report

    old_best = (tmp_path / "runs" / "reaped" / "trial-0000" / "best.pt").read_bytes()  # its first epoch's
    shutil.rmtree(tmp_path / "runs" / "ray" / "reaped")
    again = run_cli(tmp_path, "run", str(spec_path), "--quiet")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    parents, children = study_runs(tmp_path, "reaped")
    assert len(parents) == 2 and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {p.info.run_id for p in parents}
    uids = {p.data.tags.get("sweeps.study_uid") for p in parents}
    assert len(uids) == 2 and None not in uids
    moved = list((tmp_path / "runs" / "reaped" / "moved-aside").rglob("best.pt"))
    assert [p.read_bytes() for p in moved] == [old_best]
