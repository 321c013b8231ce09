"""Write the README's screenshots of a finished study: its `sweeps report` page and the MLflow UI as
a user meets it: the runs table with the trials nested under the study's run, the best trial's
page, the run-comparison view of the trials (parallel coordinates of the searched params against
the objective) and the experiment's Models tab (run `sweeps promote SPEC` first to have the
promoted model in it); and the pruned trials of a second study that prunes (``--pruned``, by
default studies/digits_cosine_bf16.yaml: the main study has no pruner), which the runs table shows
FINISHED, found by their ``sweeps.state`` tag.

From the repository root, after `make run` (or `sweeps run SPEC`), `sweeps promote SPEC` and
`sweeps run studies/digits_cosine_bf16.yaml`::

    .venv/bin/python -m scripts.screenshots                      # studies/lr_bs.yaml -> docs/img/
    .venv/bin/python -m scripts.screenshots studies/lr_bs.yaml --out docs/img

It writes ``report.png``, ``mlflow_runs.png``, ``mlflow_trial.png``, ``mlflow_compare.png``,
``mlflow_models.png`` and ``mlflow_pruned.png`` under ``--out``. It starts its own `mlflow server`
on a free loopback port over the study's store (a SQLite store; for an ``http(s)://`` tracking URI
it uses that server) and stops it at the end; it needs headless Chromium (`apt-get install -y
chromium`). Nothing is written to the store: the report page is rendered into a tmp folder and not
logged to the study's run.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from scripts.browser import INSTALL_HINT, Chromium, MlflowServer, check_png, find_chromium
from scripts.mlflow_ui import (
    collapse_sidebar,
    compare_page,
    expand,
    models_page,
    open_runs_table,
    parallel_coordinates,
    plot_axes,
    run_page,
    tidy,
)
from sweeps.tracking.layout import TAG_STATE

# Sizes in CSS pixels. The report: its headline, the optimization history and the parallel
# coordinates. The compare view: the plot and its controls, without the long table of run details
# below them.
REPORT_SIZE = (1400, 1800)
COMPARE_SIZE = (1400, 620)
PAGE_SIZE = (1400, 900)  # the runs table, a trial's page, the Models tab
# Every figure of the page is drawn when each plotly div holds its SVG.
FIGURES_DRAWN = ("(() => { const divs = [...document.querySelectorAll('.plotly-graph-div')];"
                 " return divs.length > 0 && divs.every(d => d.querySelector('svg.main-svg')); })()")


def report_png(spec_path: Path, out: Path, work: Path) -> Path:
    """Render the study's report page (`sweeps report`, into ``work``) and screenshot it."""
    from sweeps.cli import main

    page = work / "report.html"
    code = main(["report", str(spec_path), "-o", str(page), "--no-log"])
    if code != 0:
        raise SystemExit(f"sweeps report {spec_path} failed (exit {code})")
    width, height = REPORT_SIZE
    with Chromium(width, height, profile=work / "report-profile") as browser:
        browser.open(page.resolve().as_uri())
        browser.wait_for(FIGURES_DRAWN, "the report's figures")
        browser.settle()
        path = browser.screenshot(out / "report.png")
    check_png(path, width, height)
    return path


@contextlib.contextmanager
def mlflow_url(tracking_uri: str, work: Path) -> Iterator[str]:
    """The base URL of an MLflow UI over ``tracking_uri``: a server started here for a database
    store (stopped on exit), or the tracking server itself."""
    if tracking_uri.startswith(("http://", "https://")):
        yield tracking_uri.rstrip("/")
        return
    if not tracking_uri.startswith(("sqlite:", "postgresql", "mysql", "mssql")):
        raise SystemExit(f"{tracking_uri}: the screenshots need a database store or an MLflow server")
    # The UI only reads runs; artifacts are not shown on the compare page, so where they live is moot.
    with MlflowServer(tracking_uri, work / "mlartifacts", work / "mlflow-server.log") as server:
        yield server.url


def mlflow_pngs(spec, out: Path, work: Path) -> list[Path]:
    """Screenshot the MLflow UI's runs table (the trials expanded under the study's run), the best
    trial's page, the comparison of the trial runs and the Models tab."""
    from dashboards.report import load_study
    from sweeps.parent_run import reader_for

    loaded = load_study(spec)
    trials = sorted((t for t in loaded.result.trials if t.run_id), key=lambda t: t.number)
    best = loaded.result.best()
    if loaded.experiment_id is None or not trials or best is None or best.run_id is None:
        raise SystemExit(f"study {spec.name!r} has no completed trial runs in {spec.tracking_uri()}: run it "
                         f"first (sweeps run SPEC)")
    run_ids = [t.run_id for t in trials]
    parent = reader_for(spec).get_run(str(loaded.result.parent_run_id)).info.run_name
    shots = []
    with mlflow_url(spec.tracking_store_uri(), work) as base:
        width, height = PAGE_SIZE
        with Chromium(width, height, profile=work / "mlflow-profile") as browser:
            open_runs_table(browser, base, loaded.experiment_id, parent)
            collapse_sidebar(browser)
            expand(browser, parent, [f"trial-{t.number}" for t in trials[:3]])
            browser.settle()
            shots.append(_keep(browser, out / "mlflow_runs.png", PAGE_SIZE))
            browser.open(run_page(base, loaded.experiment_id, best.run_id))
            browser.wait_for_text(f"trial-{best.number}", "Parameters", "Metrics")
            browser.settle()
            shots.append(_keep(browser, out / "mlflow_trial.png", PAGE_SIZE))
            browser.open(models_page(base, loaded.experiment_id))
            browser.wait_for_text(f"trial-{best.number}", "Registered models")
            browser.settle()
            shots.append(_keep(browser, out / "mlflow_models.png", PAGE_SIZE))
        width, height = COMPARE_SIZE
        with Chromium(width, height, profile=work / "compare-profile") as browser:
            browser.open(compare_page(base, loaded.experiment_id, run_ids))
            browser.wait_for_text(f"Comparing {len(run_ids)} Runs")
            tidy(browser)
            collapse_sidebar(browser)
            axes = plot_axes(browser)
            searched = list(spec.search)
            if axes[:len(searched)] != sorted(searched):  # MLflow's default: the params that differ, sorted
                raise SystemExit(f"the comparison opens on the params {axes}, not the searched {searched}")
            print(f"the comparison opens on the axes {axes}; showing {sorted(searched)} and {spec.objective.metric}")
            # The metric axis: MLflow's default is the first metric key the runs share, in the order
            # the store returns a run's latest metrics (no ORDER BY; on SQLite the order in which
            # they were first logged): a per-step curve, logged before the first validation. So the
            # objective is picked here, as a reader picks it in the Metrics box.
            parallel_coordinates(browser, sorted(searched), [spec.objective.metric])
            browser.settle()
            shots.append(_keep(browser, out / "mlflow_compare.png", COMPARE_SIZE))
    return shots


def pruned_png(spec, out: Path, work: Path) -> Path:
    """Screenshot the runs table of ``spec``'s study filtered to its pruned trials (the
    ``sweeps.state`` tag): each one FINISHED, with a logged model of its own."""
    from dashboards.report import load_study
    from sweeps.parent_run import reader_for

    loaded = load_study(spec)
    pruned = sorted((t for t in loaded.result.trials if t.state == "PRUNED" and t.run_id), key=lambda t: t.number)
    if loaded.experiment_id is None or not pruned:
        raise SystemExit(f"study {spec.name!r} has no pruned trial runs in {spec.tracking_uri()}: run it first "
                         f"(sweeps run SPEC), or name a study with a pruner (--pruned)")
    parent = reader_for(spec).get_run(str(loaded.result.parent_run_id)).info.run_name
    with mlflow_url(spec.tracking_store_uri(), work) as base:
        with Chromium(*PAGE_SIZE, profile=work / "pruned-profile") as browser:
            open_runs_table(browser, base, loaded.experiment_id, parent, f"tags.`{TAG_STATE}` = 'PRUNED'")
            collapse_sidebar(browser)
            expand(browser, parent, [f"trial-{t.number}" for t in pruned])
            browser.settle()
            return _keep(browser, out / "mlflow_pruned.png", PAGE_SIZE)


def _keep(browser: Chromium, path: Path, size: tuple[int, int]) -> Path:
    browser.screenshot(path)
    check_png(path, *size)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.screenshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", default="studies/lr_bs.yaml", type=Path,
                        help="the finished study's spec (default: studies/lr_bs.yaml)")
    parser.add_argument("--pruned", default="studies/digits_cosine_bf16.yaml", type=Path,
                        help="a finished study with pruned trials (default: studies/digits_cosine_bf16.yaml)")
    parser.add_argument("--out", default=Path("docs/img"), type=Path, help="folder for the PNGs (default: docs/img)")
    args = parser.parse_args(argv)
    if find_chromium() is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from sweeps.spec.load import load_spec

    spec = load_spec(args.spec)
    pruned_spec = load_spec(args.pruned)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sweeps-screenshots-") as tmp:
        work = Path(tmp)
        for path in (report_png(args.spec, args.out, work), *mlflow_pngs(spec, args.out, work),
                     pruned_png(pruned_spec, args.out, work)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
