"""Faults inside trials: out of memory, hangs, disk full, bad checkpoints, a torn journal."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from sweeps.tracking import TrackingReader
from tests.reliability.hang_clock import clock_ahead_while_hung
from tests.sweeps.study_helpers import ROOT, cli_in_process, load_study, mlflow_runs, write_spec

HERE = Path(__file__).resolve().parent
PYTHONPATH = f"{HERE}:{ROOT}"


@pytest.mark.slow
def test_out_of_memory_fails_the_trial_then_retries_at_half_batch(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # fault_tasks, for the driver's check of the target
    spec = write_spec(tmp_path, name="oom", task={"name": None, "target": "fault_tasks:make_oom_task",
                                                  "model": "mlp", "args": {}},
                      train={"batch_size": 64, "grad_accum_steps": 1}, budget={"n_trials": 1,
                                                                              "oom_retry_smaller_batch": True})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", PYTHONPATH=PYTHONPATH, OOM_LIMIT="32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = load_study(tmp_path, "oom")
    first, retry = study.trials[0], study.trials[-1]
    assert first.state.name == "FAIL" and first.user_attrs["fail_reason"].startswith("out of memory")
    assert retry.state.name == "COMPLETE" and retry.user_attrs["oom_retry_of"] == first.number
    assert retry.user_attrs["train_overrides"] == {"batch_size": 32, "grad_accum_steps": 2}
    runs = {int(r.data.tags["sweeps.trial_number"]): r for r in mlflow_runs(tmp_path, "oom")
            if r.data.tags.get("sweeps.role") == "trial"}
    assert runs[first.number].info.status == "FAILED"
    assert runs[retry.number].data.params["train.batch_size"] == "32"
    assert runs[retry.number].data.params["train.grad_accum_steps"] == "2"
    assert runs[retry.number].data.params["global_batch_size"] == "64"  # the effective batch is kept


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hanging_trial_is_stopped_failed_and_the_study_goes_on(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # fault_tasks, for the driver's check of the target
    spec = write_spec(tmp_path, name="hang", task={"name": None, "target": "fault_tasks:make_hang_task",
                                                   "model": "mlp", "args": {}},
                      budget={"n_trials": 1, "trial_timeout": "40s"})
    clock_ahead_while_hung(monkeypatch, tmp_path, "hang", tmp_path / "hung-once", 40)
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet", PYTHONPATH=PYTHONPATH,
                   HANG_MARKER=str(tmp_path / "hung-once"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    study = load_study(tmp_path, "hang")
    # The first trial hangs: it is stopped and failed; a fresh worker on the same slot runs the next one.
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    assert study.trials[0].user_attrs["fail_reason"].startswith("hung: no progress")
    assert study.trials[0].user_attrs["worker"] != study.trials[1].user_attrs["worker"]
    # One worker was killed: the fresh one's start-up (imports, opening the study) is not a trial
    # and does not count against trial_timeout, however slow the machine.
    output = proc.stdout + proc.stderr
    assert output.count("trial 0 failed: hung: no progress") == 1 and "a fresh worker takes slot 0" in output, output
    runs = [r for r in mlflow_runs(tmp_path, "hang") if r.data.tags.get("sweeps.role") == "trial"]
    assert not [r for r in runs if r.info.status == "RUNNING"]


def _run_one_trial(tmp_path, monkeypatch, resume=False):
    """One trial in-process through the shared trial runner, with a real MLflow store."""
    from sweeps.parent_run import find_or_create_parent, tracker_for
    from sweeps.spec.load import load_spec
    from sweeps.trial import TrialSpec, run_trial
    from sweeps.trial_control import TrialControl

    monkeypatch.chdir(tmp_path)
    spec = load_spec(write_spec(tmp_path, name="inproc", train={"epochs": 2}))
    tracker = tracker_for(spec)
    parent = find_or_create_parent(tracker, spec, spec.name, "optuna")
    trial = TrialSpec(0, {"lr": 0.1}, tmp_path / "runs" / "inproc" / "trial-0000", parent, "optuna", resume=resume)
    return run_trial(spec, trial, TrialControl(), tracker), tracker, trial


def test_disk_full_during_checkpoint_fails_the_trial_with_the_reason(tmp_path, monkeypatch):
    from core import checkpoint as ckpt

    real_save = torch.save
    calls = {"n": 0}

    def fill_disk_on_second_checkpoint(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] >= 2:  # epoch 1 writes last.pt (best.pt links to it); epoch 2's write hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", fill_disk_on_second_checkpoint)
    outcome, tracker, trial = _run_one_trial(tmp_path, monkeypatch)
    assert outcome.state == "FAIL" and outcome.reason.startswith("disk full: ") and "MB free" in outcome.reason
    assert ckpt.load_checkpoint(trial.out_dir / ckpt.LAST)["epoch"] == 1  # the previous checkpoint is intact
    assert not [p for p in trial.out_dir.iterdir() if p.name.endswith(".tmp")]  # temporary files removed
    run = TrackingReader(tracker.tracking_uri).get_run(outcome.run.run_id)
    assert run.info.status == "FAILED" and run.data.tags["sweeps.error"].startswith("disk full: ")


def test_resume_file_with_a_pickle_payload_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    out = tmp_path / "runs" / "inproc" / "trial-0000"
    out.mkdir(parents=True)
    torch.save({"model": {}, "evil": Payload()}, out / "last.pt")
    outcome, _, _ = _run_one_trial(tmp_path, monkeypatch, resume=True)
    assert outcome.state == "FAIL"
    assert "last.pt" in outcome.reason and "refused" in outcome.reason or "no readable checkpoint" in outcome.reason
    assert not marker.exists()


@pytest.mark.slow
def test_torn_last_journal_record_is_repaired_and_the_study_resumes(tmp_path):
    spec = write_spec(tmp_path, name="torn", budget={"n_trials": 1})
    assert cli_in_process(tmp_path, "run", str(spec), "--quiet").returncode == 0
    journal = tmp_path / "runs" / "torn.journal"
    with open(journal, "ab") as fh:
        fh.write(b'{"op_code": 5, "worker_id": "dead", "trial_id": 1, "sta')  # died mid-append
    spec = write_spec(tmp_path, name="torn", budget={"n_trials": 2})
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torn last record" in proc.stderr
    study = load_study(tmp_path, "torn")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert list(journal.parent.glob("torn.journal.torn-*"))  # the cut bytes are kept


def test_corrupt_journal_record_in_the_middle_gives_a_repair_command(tmp_path):
    from sweeps.backends.journal_file import check_journal, repair_journal
    from sweeps.errors import StudyStateError

    journal = tmp_path / "x.journal"
    journal.write_bytes(b'{"op_code": 0}\n{"op_code": 4}\nGARBAGE\n{"op_code": 6}\n')
    with pytest.raises(StudyStateError, match=r"line 3: record 3 is corrupt.*sweeps repair-journal .*x.journal"):
        check_journal(journal)
    message = repair_journal(journal)
    assert "kept 2 intact records" in message
    assert journal.read_bytes() == b'{"op_code": 0}\n{"op_code": 4}\n'
    assert list(tmp_path.glob("x.journal.bak-*"))
