"""Write the README's screenshots of a finished study: its `sweeps report` page and the MLflow UI's
run-comparison view of its trials (parallel coordinates of the searched params against the
objective).

From the repository root, after `make run` (or `sweeps run SPEC`)::

    .venv/bin/python -m scripts.screenshots                      # studies/lr_bs.yaml -> docs/img/
    .venv/bin/python -m scripts.screenshots studies/lr_bs.yaml --out docs/img

It writes ``report.png`` and ``mlflow_compare.png`` under ``--out``. It starts its own `mlflow server`
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
from scripts.mlflow_ui import collapse_sidebar, compare_page, parallel_coordinates, tidy

# Sizes in CSS pixels. The report: its headline, the optimization history and the parallel
# coordinates. The compare view: the plot and its controls, without the long table of run details
# below them.
REPORT_SIZE = (1400, 1800)
COMPARE_SIZE = (1400, 620)
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


def compare_png(spec, out: Path, work: Path) -> Path:
    """Screenshot the MLflow UI's comparison of the study's trial runs."""
    from dashboards.report import load_study

    loaded = load_study(spec)
    run_ids = [t.run_id for t in sorted(loaded.result.trials, key=lambda t: t.number) if t.run_id]
    if loaded.experiment_id is None or not run_ids:
        raise SystemExit(f"study {spec.name!r} has no trial runs in {spec.tracking_uri()}: run it first "
                         f"(sweeps run SPEC)")
    params = [f"search.{name}" for name in spec.search]  # how trials log their searched params
    width, height = COMPARE_SIZE
    with mlflow_url(spec.tracking_store_uri(), work) as base, \
            Chromium(width, height, profile=work / "mlflow-profile") as browser:
        browser.open(compare_page(base, loaded.experiment_id, run_ids))
        browser.wait_for_text(f"Comparing {len(run_ids)} Runs")
        tidy(browser)
        collapse_sidebar(browser)
        parallel_coordinates(browser, params, [spec.objective.metric])
        browser.settle()
        path = browser.screenshot(out / "mlflow_compare.png")
    check_png(path, width, height)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.screenshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", default="studies/lr_bs.yaml", type=Path,
                        help="the finished study's spec (default: studies/lr_bs.yaml)")
    parser.add_argument("--out", default=Path("docs/img"), type=Path, help="folder for the PNGs (default: docs/img)")
    args = parser.parse_args(argv)
    if find_chromium() is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from sweeps.spec_checks import load_spec

    spec = load_spec(args.spec)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sweeps-screenshots-") as tmp:
        work = Path(tmp)
        for path in (report_png(args.spec, args.out, work), compare_png(spec, args.out, work)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
