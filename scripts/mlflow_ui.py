"""What a reader does in MLflow 3.17's web UI, as steps for :class:`scripts.browser.Chromium`: open an
experiment's runs table, expand a parent run, open a run's page, the run-comparison page.

The UI's routes (hash routes of its React app, from mlflow/server/js in the installed package):
``#/experiments/<id>/runs``, ``#/experiments/<id>/runs/<run_id>``, ``#/experiments/<id>/models``,
``#/compare-runs?runs=[...]&experiments=[...]``. Selectors are the UI's own stable hooks
(``data-component-id``, ``aria-label``, links to runs), not its generated CSS class names.
"""
from __future__ import annotations

import json
from urllib.parse import quote

from scripts.browser import Chromium, click

# The expander in a parent run's "Run Name" cell (runs/cells/RunNameCellRenderer.tsx in MLflow).
EXPANDER = "button[data-component-id*='runnamecellrenderer']"


def runs_page(base_url: str, experiment_id: str, search_filter: str | None = None) -> str:
    """The experiment's runs table; ``search_filter`` fills its search box (the page keeps the
    box's text in the ``searchFilter`` query parameter)."""
    query = f"?searchFilter={quote(search_filter)}" if search_filter else ""
    return f"{base_url}/#/experiments/{experiment_id}/runs{query}"


def run_page(base_url: str, experiment_id: str, run_id: str) -> str:
    return f"{base_url}/#/experiments/{experiment_id}/runs/{run_id}"


def models_page(base_url: str, experiment_id: str) -> str:
    """The experiment's Models tab: its logged models (MLflow 3)."""
    return f"{base_url}/#/experiments/{experiment_id}/models"


def compare_page(base_url: str, experiment_id: str, run_ids: list[str]) -> str:
    query = f"runs={quote(json.dumps(run_ids))}&experiments={quote(json.dumps([experiment_id]))}"
    return f"{base_url}/#/compare-runs?{query}"


def tidy(browser: Chromium) -> None:
    """Close the "MLflow Assistant" side panel and the "Got it" tip, which cover part of every page
    on a fresh profile (the UI remembers the choice in the browser's local storage)."""
    click(browser, "button[aria-label='Close']")
    click(browser, "button", "Got it")


def open_runs_table(browser: Chromium, base_url: str, experiment_id: str, parent_name: str,
                    search_filter: str | None = None) -> None:
    """Open the experiment's runs table (its runs matching ``search_filter``, and the parents of
    matching nested runs) and wait until the row of ``parent_name`` is in it (the name alone shows
    up earlier, in the breadcrumbs, before the table's rows are fetched)."""
    browser.open(runs_page(base_url, experiment_id, search_filter))
    browser.wait_for(f"[...document.querySelectorAll('[role=gridcell] a')]"
                     f".some(a => a.innerText.trim() === {json.dumps(parent_name)})", f"the row of {parent_name!r}")
    browser.wait_for_text("matching runs")
    tidy(browser)


def expand(browser: Chromium, parent_name: str, child_names: list[str]) -> None:
    """Click the expander of the row whose run is ``parent_name``; wait until ``child_names`` show."""
    found = browser.evaluate(
        f"(() => {{ const a = [...document.querySelectorAll('[role=gridcell] a')]"
        f".find(a => a.innerText.trim() === {json.dumps(parent_name)});"
        f" const b = a && a.closest('[role=gridcell]').querySelector({json.dumps(EXPANDER)});"
        " if (b) b.click(); return !!b; })()")
    if not found:
        raise AssertionError(f"no expander in the row of {parent_name!r}: {browser.text()[:2000]}")
    browser.wait_for_text(*child_names)


def run_links(browser: Chromium) -> list[dict]:
    """The run links in the runs table, top to bottom: name, href, and where the name starts
    (``left``, in CSS pixels: a nested run is indented under its parent)."""
    rows = browser.evaluate(
        "[...document.querySelectorAll('[role=gridcell] a[href*=\"/runs/\"]')].map(a => {"
        " const r = a.getBoundingClientRect();"
        " return {name: a.innerText.trim(), href: a.getAttribute('href'), left: r.left, top: r.top}; })")
    return sorted(rows or [], key=lambda r: r["top"])


def collapse_sidebar(browser: Chromium) -> None:
    """Fold the navigation side bar away: more width for tables and charts in a screenshot."""
    click(browser, "button[aria-label='Toggle sidebar']")


def _pick(browser: Chromium, select_index: int, label: str) -> None:
    """In the ``select_index``-th drop-down select of the visible tab, type ``label`` (the option list
    only renders the options in view, so filter first) and click the option named exactly that."""
    panel = "document.querySelector('[role=tabpanel][data-state=active]')"
    browser.mouse_click(f"{panel}.querySelectorAll('.du-bois-light-select-selector')[{select_index}]",
                        f"select {select_index}")
    browser.type_text(label)
    option = ("[...document.querySelectorAll('.du-bois-light-select-item-option')]"
              f".find(o => o.offsetParent !== null && o.innerText.trim() === {json.dumps(label)})")
    browser.wait_for(f"!!({option})", f"the option {label!r}")
    browser.mouse_click(option, f"the option {label!r}")
    browser.press("Escape", 27)


def parallel_coordinates(browser: Chromium, params: list[str], metrics: list[str]) -> None:
    """On the compare page: show ``params`` and ``metrics`` (MLflow names) as the parallel-coordinates
    plot's axes, instead of the UI's default (the first few params and metrics it finds)."""
    browser.wait_for_text("Parallel Coordinates Plot", "Clear All")
    click(browser, "button[data-testid='clear-button']")
    for name in params:
        _pick(browser, 0, name)
    for name in metrics:
        _pick(browser, 1, name)
    labels = [*params, *metrics]
    probe = " && ".join(f"ticks.includes({json.dumps(n)})" for n in labels)
    browser.evaluate("document.activeElement && document.activeElement.blur()")  # no focus ring on a select
    browser.wait_for(f"(() => {{ const ticks = [...document.querySelectorAll('.pcp-plot text')]"
                     f".map(t => t.textContent); return {probe}; }})()", f"the plot's axes {labels}")


def plot_axes(browser: Chromium) -> list[str]:
    """The axis titles of the compare page's parallel-coordinates plot, left to right."""
    browser.wait_for_text("Parallel Coordinates Plot")
    browser.wait_for("document.querySelectorAll('.pcp-plot text').length > 0", "the plot's axes")
    return browser.evaluate("[...document.querySelectorAll('.pcp-plot .axis-title')].map(t => t.textContent)") or []
