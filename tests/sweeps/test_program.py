"""The printed next steps run as printed: ``sweeps`` when PATH finds this program, else its path
(``make run`` starts ``.venv/bin/sweeps``, which is not on PATH); the end table says it shows the
best 5 and wraps long values rather than cutting them."""
from __future__ import annotations

import sys

from rich.console import Console

from dashboards.page import header_from_spec, render_page
from dashboards.tables import build_tables
from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.live import print_summary
from sweeps.program import sweeps_command
from sweeps.spec.load import spec_from_dict
from tests.sweeps.study_helpers import tiny_spec


def _installed(tmp_path, monkeypatch, on_path: bool):
    script = tmp_path / ".venv" / "bin" / "sweeps"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [".venv/bin/sweeps", "run", "s.yaml"])
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin" if on_path else "/usr/bin:/bin")
    return script


def test_the_command_is_the_running_scripts_path_when_path_does_not_find_it(tmp_path, monkeypatch):
    script = _installed(tmp_path, monkeypatch, on_path=False)
    assert sweeps_command() == ".venv/bin/sweeps"
    monkeypatch.setattr(sys, "argv", [str(script), "run", "s.yaml"])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # outside the working folder: the absolute path
    assert sweeps_command() == str(script)


def test_the_command_is_sweeps_when_path_finds_this_program(tmp_path, monkeypatch):
    _installed(tmp_path, monkeypatch, on_path=True)
    assert sweeps_command() == "sweeps"


def _result(n: int) -> StudyResult:
    trials = [TrialRecord(i, "COMPLETE", {"lr": 0.001 * (i + 1), "batch_size": 128}, 0.9 + i / 1000, 1.0,
                          f"{i:032x}") for i in range(n)]
    return StudyResult("tiny", "optuna", "maximize", "val_acc", trials)


def test_the_end_of_a_run_prints_runnable_next_steps_and_says_it_shows_the_best_5(tmp_path, monkeypatch):
    _installed(tmp_path, monkeypatch, on_path=False)
    spec = spec_from_dict(tiny_spec(), path="s.yaml")
    console = Console(width=80, record=True)
    print_summary(spec, _result(7), console)
    text = console.export_text()
    assert "study tiny: 7 complete; the best 5 of 7 shown (all: status)" in " ".join(text.split())
    for step in ("status s.yaml", "promote s.yaml", "rerun s.yaml --trial 6", "report s.yaml"):
        assert f".venv/bin/sweeps {step}" in text
    assert " sweeps " not in text.replace(".venv/bin/sweeps", "")
    assert "…" not in text and "batch_size=12" in text  # values wrap, none cut to an ellipsis
    assert "".join(text.split()).count("batch_size=128") == 5
    narrow = Console(width=30, record=True)  # a step is one line to copy, however narrow the terminal
    print_summary(spec, _result(7), narrow)
    assert "  rerun it:           .venv/bin/sweeps rerun s.yaml --trial 6" in narrow.export_text().splitlines()


def test_the_report_page_prints_runnable_commands(tmp_path, monkeypatch):
    _installed(tmp_path, monkeypatch, on_path=False)
    spec = spec_from_dict(tiny_spec(), path="s.yaml")
    page = render_page(build_tables(_result(3)), header_from_spec(spec))
    assert ".venv/bin/sweeps promote s.yaml\n.venv/bin/sweeps rerun s.yaml --trial 2" in page
    assert "<code>.venv/bin/sweeps report s.yaml</code>" in page
