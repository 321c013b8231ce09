"""The study report: one self-contained HTML page (plotly.js inline, no network needed).

:func:`render_page` turns the tables (and the figures drawn from them) into HTML;
:func:`write_page` writes it atomically. The page opens from disk in any browser, offline.
"""
from __future__ import annotations

import datetime as _dt
import html
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import plotly.io as pio
from plotly.offline import get_plotlyjs

from dashboards.figures import all_figures
from dashboards.tables import IMPORTANCE_ENOUGH_COMPLETE, StudyTables, ranked_trials
from sweeps.program import sweeps_command

OPTUNA_STARTUP_TRIALS = 10  # TPESampler's and GPSampler's n_startup_trials when the spec sets none

QUESTION_RE = re.compile(r"^\s*#\s*Question:\s*(.*?)\s*$", re.IGNORECASE)
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}

SECTIONS = {  # div id -> (heading, what the figure shows)
    "fig-history": ("Optimization history", "Each finished trial's value by trial number: the objective at its "
                    "best epoch (the checkpoint promote registers), for completed and pruned trials alike; "
                    "crosses are pruned trials, stopped before their last epoch. The line is the best completed "
                    "value so far."),
    "fig-parallel": ("Parameters against the objective", "One line per completed trial through its parameter "
                     "values and its objective, coloured by the objective. Drag along an axis to filter."),
    "fig-importances": ("Parameter importances", "fANOVA importances of the searched parameters for the "
                        "objective (they sum to 1; few trials make them rough). From the completed trials at "
                        f"their value when at least {IMPORTANCE_ENOUGH_COMPLETE} completed; with fewer, from "
                        "the completed and pruned trials at the objective after an epoch they all reached. The "
                        "note under the bars says which."),
    "fig-pair": ("Objective by the two main parameters", "Each finished trial at its two parameter values "
                 "(learning rate x batch size when both were searched, else the two most important), coloured "
                 "by the objective."),
    "fig-curves": ("Learning curves", "The objective metric of every trial after each epoch, from the trials' "
                   "MLflow runs. Pruned trials are dashed and faded (they stop early); the best trial is thick "
                   "and green."),
    "fig-lr-finder": ("LR range test", "The training loss while the learning rate ramps up exponentially on a "
                      "fresh model, before the trials; the dashed line is the suggested learning rate."),
    "fig-front": ("Pareto front", "The completed trials by their objectives: the front (no other trial is at "
                  "least as good in every objective and better in one) in colour, the dominated trials grey. "
                  "Two objectives: a scatter; more: parallel coordinates."),
    "fig-states": ("Trials by state", "How many trials completed, were pruned, failed or are still running."),
    "fig-durations": ("Time per trial", "Wall-clock seconds of each trial (pruned trials stop early)."),
}

CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1250px; padding: 24px 32px; color: #222; line-height: 1.45; }
h1 { margin-bottom: 4px; } h2 { margin-top: 36px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; margin-top: 0; }
.box { background: #f6f8fa; border: 1px solid #e1e4e8; border-radius: 6px; padding: 12px 16px; margin: 12px 0; }
.best { border-left: 5px solid #2ca02c; }
pre { background: #272822; color: #f8f8f2; padding: 10px 14px; border-radius: 6px; overflow-x: auto; }
code { background: #f0f0f0; padding: 1px 4px; border-radius: 3px; }
pre code { background: none; padding: 0; }
table.trials { border-collapse: collapse; font-size: 13px; width: 100%; }
table.trials th, table.trials td { border-bottom: 1px solid #eee; padding: 3px 8px; text-align: right; }
table.trials th { background: #f6f8fa; }
table.trials tr.is-best td { background: #e8f5e9; font-weight: 600; }
table.trials tr.state-PRUNED td, table.trials tr.state-FAIL td { color: #888; }
.note { color: #555; font-style: italic; }
.figure { margin: 8px 0 0 0; }
"""


@dataclass
class PageHeader:
    """What the page says about the study besides the tables."""

    spec_path: str  # as the user gives it to the CLI: the commands on the page use it
    description: str = ""
    question: str = ""
    lr_finder_enabled: bool = False
    budget: int | None = None
    program: str = "sweeps"  # the command that runs sweeps here (sweeps.program.sweeps_command)
    random_start: int = 0  # tpe/gp: the first trials drawn at random before the model guides the search


def question_of(spec_path: str | Path | None) -> str:
    """The text of the first ``# Question:`` comment line of the spec file ('' when none)."""
    if spec_path is None or not Path(spec_path).is_file():
        return ""
    for line in Path(spec_path).read_text(encoding="utf-8", errors="replace").splitlines():
        m = QUESTION_RE.match(line)
        if m:
            return m.group(1)
    return ""


def header_from_spec(spec) -> PageHeader:
    """A :class:`PageHeader` from a loaded ``StudySpec``."""
    path = str(spec.path) if spec.path is not None else "SPEC"
    return PageHeader(spec_path=path, description=spec.description, question=question_of(spec.path),
                      lr_finder_enabled=spec.lr_finder.enabled, budget=spec.budget.n_trials,
                      program=sweeps_command(), random_start=_random_start(spec))


def _random_start(spec) -> int:
    """How many first trials a model-based sampler draws at random (Optuna's default: 10); 0 for the others."""
    if spec.sampler.name not in ("tpe", "gp"):
        return 0
    return spec.sampler.n_startup_trials or OPTUNA_STARTUP_TRIALS


def guided_sentence(t: StudyTables, h: PageHeader) -> str:
    """One sentence: the median objective of the trials the sampler guided against the random start's
    (finished trials at their value; '' when either group is empty or the study has several objectives)."""
    if not h.random_start or t.objectives:
        return ""
    done = t.trials[t.trials["state"].isin(["COMPLETE", "PRUNED"]) & t.trials["value"].notna()]
    start, guided = done[done["number"] < h.random_start], done[done["number"] >= h.random_start]
    if start.empty or guided.empty:
        return ""
    a, b = float(guided["value"].median()), float(start["value"].median())
    better = (a > b) if t.direction == "maximize" else (a < b)
    verdict = "better than" if better else ("as good as" if a == b else "worse than")
    return (f"The {len(guided)} trials the sampler guided reached a median {t.metric} of {a:.4g}, {verdict} the "
            f"{b:.4g} of the {len(start)} random trials it started with.")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _fmt(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _header_html(t: StudyTables, h: PageHeader) -> str:
    counts = ", ".join(f"{int(r['count'])} {str(r['state']).lower()}" for _, r in t.state_counts.iterrows())
    budget = f" of a budget of {h.budget}" if h.budget else ""
    parts = [f"<h1>Study <code>{_e(t.study)}</code></h1>",
             f"<p class='sub'>backend {_e(t.backend)} &middot; objective: {_e(t.direction)} {_e(t.metric)} &middot; "
             f"trials: {_e(counts or 'none')}{_e(budget)} &middot; spec <code>{_e(h.spec_path)}</code></p>"]
    if h.description or h.question:
        parts.append("<div class='box'><b>Question.</b> ")
        if h.question:
            parts.append(f"{_e(h.question)}")
        if h.description and h.description != h.question:
            parts.append(f"<br><span class='sub'>{_e(h.description)}</span>")
        parts.append("</div>")
    best = t.best_row()
    if best is None:
        parts.append("<div class='box'><b>No completed trial yet.</b> Run or resume the study with "
                     f"<code>{_e(h.program)} run {_e(h.spec_path)}</code>.</div>")
    else:
        number = int(best["number"])
        params = ", ".join(f"{_e(p)}=<b>{_e(_fmt(best[p]))}</b>" for p in t.param_names)
        cmds = (f"{h.program} promote {h.spec_path}\n{h.program} rerun {h.spec_path} --trial {number}\n"
                f"{h.program} status {h.spec_path}")
        parts.append(f"<div class='box best'><b>Best trial: {number}</b> &mdash; {_e(t.metric)} = "
                     f"<b>{best['value']:.4f}</b><br>{params}<br><span class='sub'>MLflow run "
                     f"<code>{_e(best['run_id'] or '-')}</code></span>"
                     f"<p>Promote it (register its model) and rerun it (same config and seed, to check it "
                     f"reproduces):</p><pre><code>{_e(cmds)}</code></pre></div>")
    return "\n".join(parts)


def _lr_finder_note(t: StudyTables, h: PageHeader) -> str:
    if h.lr_finder_enabled:
        return ("<p class='note'>The spec enables the LR finder, but the study's parent run has no "
                "<code>lr_finder/lr_finder.json</code>: the study started before it was enabled, or the range "
                f"test failed. Start a new version with <code>{_e(h.program)} run "
                f"{_e(h.spec_path)} --fresh</code> to run it.</p>")
    return ("<p class='note'>The LR range test did not run for this study. To run it once before the trials "
            "(and narrow the <code>lr</code> search range around its suggestion), add "
            "<code>lr_finder: {enabled: true}</code> to the spec.</p>")


def _trials_html(t: StudyTables) -> str:
    df = ranked_trials(t.trials, t.direction)
    # Several objectives: each objective, on_front and the deployment figures (latency with its spread).
    extra = [c for c in df.columns if c.startswith(("objective:", "figure:")) or c == "on_front"]
    cols = ["number", "state", "value", *t.param_names, *extra, "duration_s", "run_id"]
    head = "".join(f"<th>{_e(c)}</th>" for c in ["", *cols])
    rows = []
    for _, r in df.iterrows():
        cls = f"state-{_e(r['state'])}" + (" is-best" if r["is_best"] else "")
        cells = "".join(f"<td>{_e(_fmt(r[c]))}</td>" for c in cols)
        rows.append(f"<tr class='{cls}'><td>{'&#9733;' if r['is_best'] else ''}</td>{cells}</tr>")
    return f"<table class='trials'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def figure_div(fig, div_id: str) -> str:
    """One figure as a div + script, without plotly.js (the page carries it once)."""
    height = fig.layout.height or 450
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, include_mathjax=False, div_id=div_id,
                       config=PLOTLY_CONFIG, default_height=f"{height}px", default_width="100%")


def render_page(t: StudyTables, h: PageHeader, now: _dt.datetime | None = None) -> str:
    """The whole page as a string: plotly.js inline in the head, then the header, one section
    per figure (the LR-finder section is a note when the study ran none), the trials table."""
    now = now or _dt.datetime.now().astimezone()
    body = [_header_html(t, h)]
    for div_id, fig in all_figures(t).items():
        heading, caption = SECTIONS[div_id]
        body.append(f"<section id='{div_id}-section'><h2>{_e(heading)}</h2>")
        if fig is None:
            body.append(_lr_finder_note(t, h))
        else:
            said = f" {guided_sentence(t, h)}" if div_id == "fig-history" else ""
            body.append(f"<p>{_e(caption + said)}</p><div class='figure'>{figure_div(fig, div_id)}</div>")
        body.append("</section>")
    body.append("<section id='trials-section'><h2>All trials</h2><p>Completed trials best first, then the "
                "rest by number (&#9733; = best).</p>" + _trials_html(t) + "</section>")
    body.append(f"<p class='sub'>Generated {_e(now.strftime('%Y-%m-%d %H:%M:%S %Z'))} by "
                f"<code>{_e(h.program)} report {_e(h.spec_path)}</code>.</p>")
    return ("<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
            f"<title>Study {_e(t.study)}: report</title>\n<style>{CSS}</style>\n"
            "<script type='text/javascript'>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
            f"<script type='text/javascript'>{get_plotlyjs()}</script>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def write_page(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary file in the same folder, then
    ``os.replace``): a reader never sees half a page, and a failed write leaves the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
