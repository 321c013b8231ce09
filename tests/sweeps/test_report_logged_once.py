"""`sweeps report` logs its page to the study's parent run once: every call replaces the page
there (whatever -o names the file), so the store holds one copy after any number of calls."""
from __future__ import annotations

from pathlib import Path

import pytest

from sweeps import cli
from tests.sweeps.study_fixtures import finished_study, in_study  # noqa: F401

pytestmark = pytest.mark.slow


def _report_files(client, parent_id: str) -> dict[str, int]:
    """path -> size of every file under the parent run's report/ folder, in the store."""
    return {a.path: a.file_size for a in client.list_artifacts(parent_id, "report")}


def test_three_reports_leave_one_page_in_the_study_run(in_study, capsys):  # noqa: F811 - the fixture
    client = in_study.client()
    exp = client.get_experiment_by_name(in_study.name)
    [parent] = client.search_runs([exp.experiment_id], "tags.`sweeps.role` = 'study'")
    parent_id = parent.info.run_id

    outs = []
    for output in (None, "elsewhere/page.html", "another-name.html"):
        args = ["report", str(in_study.spec)] + (["-o", output] if output else [])
        assert cli.main(args) == 0
        outs.append(capsys.readouterr().out)
        page = Path(output) if output else in_study.root / "runs" / in_study.name / "report.html"
        assert page.is_file()

    files = _report_files(client, parent_id)
    assert list(files) == ["report/report.html"]  # replaced each time, never a second copy
    assert files["report/report.html"] == Path("another-name.html").stat().st_size  # the latest page
    artifacts = Path(parent.info.artifact_uri.removeprefix("file://")) / "report"
    assert sum(f.stat().st_size for f in artifacts.rglob("*") if f.is_file()) == files["report/report.html"]
    assert all(f"logged to MLflow run {parent_id} as report/report.html" in out for out in outs)
