"""The MLflow web UI on a real finished study, in a real headless Chromium: a real `mlflow server` on
a free loopback port over the study's SQLite store, the browser driven over the DevTools protocol
(scripts/browser.py; the README's screenshot script uses the same helpers).

The study: the tiny digits MLP, 3 trials x 2 epochs (random sampler), run by `sweeps run` in a tmp
folder. What a reader should see: the experiment named after the study, one top-level run (the
study's), the trials nested under it once it is expanded, and the best trial's page with its
params and metrics. Screenshots are kept as test artifacts: under $SWEEPS_TEST_ARTIFACTS when set,
else under the test's tmp folder; their paths are printed (`pytest -s` shows them).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from scripts.browser import INSTALL_HINT, Chromium, MlflowServer, check_png, find_chromium
from scripts.mlflow_ui import expand, open_runs_table, run_links, run_page, tidy
from tests.sweeps.study_helpers import save_spec, tiny_spec

pytestmark = [pytest.mark.slow, pytest.mark.browser]

STUDY = "ui_study"
WIDTH, HEIGHT = 1400, 900


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A finished 3-trial study in a tmp folder; its experiment, study run and trial runs."""
    from mlflow.tracking import MlflowClient

    from sweeps import cli

    root = tmp_path_factory.mktemp("mlflow-ui-study")
    spec = save_spec(root, tiny_spec(STUDY, budget={"n_trials": 3, "max_failures": 1}))
    before = os.getcwd()
    os.chdir(root)  # the spec's runs/ paths are relative to the working directory
    try:
        assert cli.main(["run", str(spec), "--quiet"]) == 0
    finally:
        os.chdir(before)
    uri = f"sqlite:///{root / 'runs' / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(STUDY)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if r.data.tags.get("sweeps.role") == "study")
    trials = [r for r in runs if r.data.tags.get("sweeps.role") == "trial"]
    assert len(trials) == 3 and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in trials)
    return {"root": root, "uri": uri, "experiment_id": exp.experiment_id, "parent": parent, "trials": trials}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = os.environ.get("SWEEPS_TEST_ARTIFACTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def server(study):
    with MlflowServer(study["uri"], study["root"] / "runs" / "mlartifacts", study["root"] / "server.log") as srv:
        yield srv


@pytest.fixture
def browser(tmp_path):
    # The test never installs Chromium (that is CI's set-up); without it the test fails, saying how
    # to get it, rather than passing as a skip.
    if find_chromium() is None:
        pytest.fail(f"{INSTALL_HINT}; `make test-fast` leaves this test out (marker: browser)", pytrace=False)
    with Chromium(WIDTH, HEIGHT, profile=tmp_path / "profile") as chromium:
        yield chromium


def _keep(browser: Chromium, artifacts: Path, name: str) -> Path:
    path = browser.screenshot(artifacts / name)
    print(f"screenshot: {path}")
    check_png(path, WIDTH, HEIGHT)
    return path


def test_experiment_page_lists_the_trials_nested_under_the_study_run(study, server, browser, artifacts):
    parent, trials = study["parent"], study["trials"]
    names = sorted(r.info.run_name for r in trials)
    open_runs_table(browser, server.url, study["experiment_id"], parent.info.run_name)
    # Collapsed at first: one top-level row, the study's; its trials are behind its expander.
    shown = run_links(browser)
    assert [r["name"] for r in shown] == [parent.info.run_name], shown
    assert not any(name in browser.text() for name in names)
    assert re.search(r"\b4\s+matching runs", browser.text())  # the table still counts the nested ones
    expand(browser, parent.info.run_name, names)
    browser.settle()
    rows = run_links(browser)
    assert rows[0]["name"] == parent.info.run_name and rows[0]["href"].endswith(f"/runs/{parent.info.run_id}")
    children = rows[1:]
    assert sorted(r["name"] for r in children) == names
    by_name = {r.info.run_name: r.info.run_id for r in trials}
    for row in children:  # each row links to its own trial's run, indented under the study's
        assert row["href"].endswith(f"/runs/{by_name[row['name']]}")
        assert row["left"] > rows[0]["left"] and row["top"] > rows[0]["top"]
    _keep(browser, artifacts, "mlflow_experiment_runs.png")


def test_best_trial_run_page_shows_its_params_and_metrics(study, server, browser, artifacts):
    best = max(study["trials"], key=lambda r: r.data.metrics["val_acc"])
    browser.open(run_page(server.url, study["experiment_id"], best.info.run_id))
    lr = best.data.params["lr"]
    text = browser.wait_for_text(best.info.run_name, "lr", lr, "val_acc", "Parent run")
    tidy(browser)
    browser.settle()
    assert best.info.run_id in text
    parent = study["parent"].info
    links = browser.evaluate(f"[...document.querySelectorAll('a[href$=\"/runs/{parent.run_id}\"]')]"
                             ".map(a => a.innerText.trim())")
    assert parent.run_name in links, f"no link to the parent run {parent.run_name!r}: {links}"
    acc = best.data.metrics["val_acc"]
    assert str(acc)[:6] in text, f"val_acc {acc} is not on the page:\n{text[:3000]}"
    others = [r for r in study["trials"] if r.info.run_id != best.info.run_id]
    assert not any(r.data.params["lr"] in text for r in others)  # this trial's page, not another's
    _keep(browser, artifacts, "mlflow_best_trial.png")


def test_runs_table_searched_by_a_trial_tag_shows_only_its_trials(study, server, browser):
    """The screenshot script finds a study's pruned trials so (by ``sweeps.state``); here, one
    trial by its number tag: the table holds it and its study's run, not the other trials."""
    parent = study["parent"].info.run_name
    one = next(r for r in study["trials"] if r.data.tags["sweeps.trial_number"] == "1")
    open_runs_table(browser, server.url, study["experiment_id"], parent, "tags.`sweeps.trial_number` = '1'")
    assert "tags.`sweeps.trial_number` = '1'" in browser.evaluate(
        "[...document.querySelectorAll('input')].map(i => i.value).join('|')")
    expand(browser, parent, [one.info.run_name])
    browser.settle()
    assert [r["name"] for r in run_links(browser)] == [parent, one.info.run_name]
    assert re.search(r"\b2\s+matching runs", browser.text())
