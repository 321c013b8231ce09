"""`sweeps report` on a study whose completed trials all have the same parameters (as a
resumed study left them when its sampler repeated its draws): the page is written and its
importances figure says why there are none, instead of fANOVA's "zero total variance" crash."""
from __future__ import annotations

import html

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from tests.sweeps.study_helpers import cli_in_process, load_study, write_spec

pytestmark = pytest.mark.slow


def test_report_of_identical_trials_says_why_importances_are_unavailable(tmp_path):
    spec = write_spec(tmp_path, name="same", budget={"n_trials": 2})
    # The same parameters queued twice before the study runs; `sweeps run` takes queued trials first.
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "runs" / "same.journal")))
    queued = optuna.create_study(study_name="same", storage=storage, direction="maximize")
    for _ in range(2):
        queued.enqueue_trial({"lr": 0.1}, skip_if_exists=False)
    proc = cli_in_process(tmp_path, "run", str(spec), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = load_study(tmp_path, "same").trials
    assert [(t.state.name, t.params) for t in trials] == [("COMPLETE", {"lr": 0.1})] * 2

    report = cli_in_process(tmp_path, "report", str(spec))
    assert report.returncode == 0, report.stdout + report.stderr
    page = (tmp_path / "runs" / "same" / "report.html").read_text()
    # The reason is a figure annotation inside the page's JSON: undo its escapes and line breaks.
    text = html.unescape(page.replace("\\u003c", "<").replace("\\u003e", ">")).replace("<br>", " ")
    assert ("parameter importances are unavailable: all 2 completed trials have the same parameters (lr=0.1), "
            "so none of them can explain a difference in val_acc") in text
