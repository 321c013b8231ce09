"""Plotly figures of a study, each drawn from the tables of :mod:`dashboards.tables` only
(no storage or MLflow access here: what a figure shows is what its table holds).

Every function returns a figure even when its table is empty (the figure then says why),
so the page always has the same sections; only :func:`pareto_figure` returns None, for a study of
one objective.

The Pareto front of a study of several objectives is drawn from the trials table's
``objective:<metric>`` and ``on_front`` columns. Two objectives: a scatter of every completed
trial, the front in colour joined by its steps and the dominated trials greyed. More: a
parallel-coordinates view, one line per completed trial through its objectives, the front
coloured and the rest grey. The README's picture (scripts/pareto_figure.py) is drawn from the
same table.
"""
from __future__ import annotations

import math
import textwrap

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboards.tables import StudyTables, top_two_params

STATE_COLORS = {"COMPLETE": "#1f77b4", "PRUNED": "#ff7f0e", "FAIL": "#d62728", "RUNNING": "#7f7f7f",
                "WAITING": "#bcbd22"}
BEST_COLOR = "#2ca02c"
FRONT_COLOR = "#2ca02c"
DOMINATED_COLOR = "#b0b0b0"
HEIGHT = 420
EMPTY_WRAP = 80  # characters per line of the reason an empty figure gives


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    fig.update_layout(title=title, height=kw.pop("height", HEIGHT), template="plotly_white",
                      margin=kw.pop("margin", dict(l=70, r=30, t=60, b=60)), **kw)
    return fig


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    # Plotly never wraps an annotation: a long reason would run off both sides of the figure.
    text = "<br>".join(textwrap.wrap(why, EMPTY_WRAP)) or why
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height=220)


def _fmt(value) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _params_text(row: pd.Series, names: list[str]) -> str:
    return "<br>".join(f"{n}={_fmt(row[n])}" for n in names)


def optimization_history(t: StudyTables) -> go.Figure:
    """Each finished trial's value (its objective at its best epoch; pruned ones faded crosses) and
    the best-so-far line."""
    title = f"Optimization history ({t.metric}, {t.direction})"
    df = t.best_so_far
    if df["value"].notna().sum() == 0:
        return _empty(title, "no finished trial has a value yet")
    fig = go.Figure()
    trials = t.trials.set_index("number")
    for state, symbol, opacity in (("COMPLETE", "circle", 1.0), ("PRUNED", "x", 0.55), ("FAIL", "x", 0.55)):
        sub = df[(df["state"] == state) & df["value"].notna()]
        if sub.empty:
            continue
        text = [_params_text(trials.loc[n], t.param_names) for n in sub["number"]]
        fig.add_trace(go.Scatter(x=sub["number"], y=sub["value"], mode="markers", name=state.lower(),
                                 marker=dict(color=STATE_COLORS[state], symbol=symbol, size=9), opacity=opacity,
                                 text=text, hovertemplate="trial %{x}<br>" + t.metric + "=%{y:.4f}<br>%{text}"
                                                          "<extra></extra>"))
    best = df[df["best_so_far"].notna()]
    if not best.empty:
        fig.add_trace(go.Scatter(x=best["number"], y=best["best_so_far"], mode="lines", name="best so far",
                                 line=dict(color=BEST_COLOR, width=3, shape="hv")))
    return _layout(fig, title, xaxis=_trial_axis(df["number"]), yaxis_title=t.metric)


def _trial_axis(numbers: pd.Series) -> dict:
    """Trial numbers are whole: a tick per trial for small studies, whole-number ticks otherwise."""
    n = int(numbers.max()) + 1 if len(numbers) else 1
    return dict(title="trial", tick0=0, dtick=1 if n <= 25 else max(1, round(n / 20)))


def _axis_values(series: pd.Series, kind: str) -> dict:
    """A parcoords dimension for one parameter: log10 for log params, indices for categories."""
    if kind == "categorical":
        labels = _category_order(series)
        index = {label: i for i, label in enumerate(labels)}
        return dict(values=[index[str(v)] for v in series], tickvals=list(range(len(labels))), ticktext=labels)
    values = series.astype("float64")
    if kind == "log":
        logs = np.log10(values.clip(lower=np.finfo(float).tiny))
        lo, hi = math.floor(logs.min()), math.ceil(logs.max())
        hi = max(hi, lo + 1)
        ticks = [m * 10.0 ** k for k in range(lo, hi + 1) for m in (1, 2, 5) if k + math.log10(m) <= hi]
        return dict(values=logs, range=[lo, hi], tickvals=[math.log10(v) for v in ticks],
                    ticktext=[f"{v:g}" for v in ticks])
    return dict(values=values)


def _category_order(series: pd.Series) -> list[str]:
    values = list(dict.fromkeys(series.tolist()))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        values = sorted(values)
    return [str(v) for v in values]


def parallel_coordinates(t: StudyTables) -> go.Figure:
    """Parameters of the COMPLETE trials against the objective, coloured by the objective."""
    title = f"Parameters against {t.metric} (completed trials)"
    df = t.trials[(t.trials["state"] == "COMPLETE") & t.trials["value"].notna()]
    if df.empty or not t.param_names:
        return _empty(title, "no completed trial yet" if df.empty else "the study searched no parameters")
    dims = []
    for name in t.param_names:
        col = df[name]
        if col.isna().all():
            continue
        kind = t.param_kinds.get(name, "linear")
        dims.append(dict(label=name + (" (log)" if kind == "log" else ""), **_axis_values(col, kind)))
    dims.append(dict(label=t.metric, values=df["value"]))
    line = dict(color=df["value"], colorscale="Viridis", showscale=True,
                reversescale=t.direction == "minimize", colorbar=dict(title=t.metric))
    fig = go.Figure(go.Parcoords(line=line, dimensions=dims, labelside="bottom"))
    return _layout(fig, title, margin=dict(l=80, r=80, t=70, b=60))


def param_importances(t: StudyTables) -> go.Figure:
    title = f"Parameter importances for {t.metric} (fANOVA)"
    df = t.importances
    if df.empty:
        return _empty(title, t.importance_note or "no importances")
    df = df.sort_values("importance")  # the most important on top of a horizontal bar chart
    fig = go.Figure(go.Bar(x=df["importance"], y=df["param"], orientation="h", marker_color=STATE_COLORS["COMPLETE"],
                           text=[f"{v:.2f}" for v in df["importance"]], textposition="auto",
                           hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    # Which trials and which value the importances come from: pruned trials may be among them.
    basis = "<br>".join(textwrap.wrap(t.importance_note, EMPTY_WRAP + 40))
    fig.add_annotation(text=basis, showarrow=False, x=0, y=-0.25, xref="paper", yref="paper", xanchor="left",
                       yanchor="top", align="left", font=dict(size=12, color="#555"))
    return _layout(fig, title, xaxis_title="importance (sums to 1)", xaxis_range=[0, 1],
                   height=max(260, 130 + 40 * len(df)), margin=dict(l=70, r=30, t=60, b=110))


def _axis(kind: str, series: pd.Series) -> dict:
    if kind == "log":
        return dict(type="log")
    if kind == "categorical":
        return dict(type="category", categoryorder="array", categoryarray=_category_order(series))
    return dict(type="linear")


def param_pair(t: StudyTables) -> go.Figure:
    """The objective over lr x batch_size (or the two most important parameters)."""
    pair = top_two_params(t)
    df = t.trials[t.trials["state"].isin(["COMPLETE", "PRUNED"]) & t.trials["value"].notna()]
    if not pair:
        return _empty("Objective by parameter", "the study searched no parameters")
    title = f"{t.metric} by {' x '.join(pair)}"
    if df.empty:
        return _empty(title, "no finished trial has a value yet")
    x = df[pair[0]] if t.param_kinds.get(pair[0]) != "categorical" else df[pair[0]].astype(str)
    if len(pair) == 1:
        y, ytitle, yaxis = df["value"], t.metric, {}
    else:
        y = df[pair[1]] if t.param_kinds.get(pair[1]) != "categorical" else df[pair[1]].astype(str)
        ytitle, yaxis = pair[1], _axis(t.param_kinds.get(pair[1], "linear"), df[pair[1]])
    symbols = ["circle" if s == "COMPLETE" else "x" for s in df["state"]]
    sizes = [16 if b else 11 for b in df["is_best"]]
    text = [f"trial {n} ({s.lower()})" for n, s in zip(df["number"], df["state"], strict=True)]
    fig = go.Figure(go.Scatter(
        x=x, y=y, mode="markers", text=text, customdata=df["value"],
        marker=dict(color=df["value"], colorscale="Viridis", reversescale=t.direction == "minimize", size=sizes,
                    symbol=symbols, showscale=True, colorbar=dict(title=t.metric),
                    line=dict(width=[3 if b else 0.5 for b in df["is_best"]], color="black")),
        hovertemplate="%{text}<br>" + t.metric + "=%{customdata:.4f}<extra></extra>"))
    fig.update_xaxes(title=pair[0], **_axis(t.param_kinds.get(pair[0], "linear"), df[pair[0]]))
    fig.update_yaxes(title=ytitle, **yaxis)
    return _layout(fig, title + "  (crosses: pruned; outlined: best)")


def learning_curves(t: StudyTables, metric: str | None = None) -> go.Figure:
    """``metric`` (the objective by default) against epoch for every trial: pruned trials dashed
    and faded, failed ones dotted, the best trial thick and green."""
    metric = metric or t.metric
    title = f"Learning curves: {metric} per epoch"
    df = t.curves[["number", "state", "epoch", metric]].dropna(subset=[metric]) if metric in t.curves else t.curves
    if df.empty:
        return _empty(title, "no trial has logged a per-epoch value yet")
    best = t.best_row()
    best_number = None if best is None else int(best["number"])
    trials = t.trials.set_index("number")
    shown: set[str] = set()
    fig = go.Figure()
    # The best trial last, so its line is drawn on top of the others.
    groups = sorted(df.groupby("number", sort=True), key=lambda g: g[0] == best_number)
    for number, sub in groups:
        state = str(sub["state"].iloc[0])
        is_best = number == best_number
        style = dict(color=STATE_COLORS.get(state, "#7f7f7f"), width=1.5)
        opacity = 0.85
        marker: dict[str, int | str] = dict(size=5)
        if state == "PRUNED":  # the cross marks where it was stopped (a trial pruned after 1 epoch is one point)
            style.update(dash="dash")
            opacity = 0.55
            marker = dict(size=9, symbol="x")
        elif state == "FAIL":
            style.update(dash="dot")
            opacity = 0.45
        if is_best:
            style = dict(color=BEST_COLOR, width=4)
            opacity = 1.0
        group = "best" if is_best else state
        name = f"best: trial {number}" if is_best else state.lower()
        params = _params_text(trials.loc[number], t.param_names) if number in trials.index else ""
        fig.add_trace(go.Scatter(x=sub["epoch"], y=sub[metric], mode="lines+markers", line=style, opacity=opacity,
                                 marker=marker, name=name, legendgroup=group, showlegend=group not in shown,
                                 hovertemplate=f"trial {number} ({state.lower()})<br>epoch %{{x}}<br>{metric}="
                                               f"%{{y:.4f}}<br>{params}<extra></extra>"))
        shown.add(group)
    fig.update_xaxes(dtick=1)
    return _layout(fig, title, xaxis_title="epoch", yaxis_title=metric)


def _loss_range(df: pd.DataFrame) -> tuple[float, float]:
    """A y range for the LR-finder plot: every loss, but capped where the loss explodes at the end
    of the ramp (at the first smoothed loss plus its drop to the minimum, or a quarter of it)."""
    smoothed = df["smoothed"][np.isfinite(df["smoothed"])]
    values = pd.concat([smoothed, df["loss"][np.isfinite(df["loss"])]])
    if values.empty:
        return 0.0, 1.0
    lo = float(values.min())
    first = float(smoothed.iloc[0]) if not smoothed.empty else float(values.iloc[0])
    cap = first + max(first - lo, 0.25 * abs(first), 1e-6)
    hi = min(float(values.max()), cap)
    pad = 0.05 * max(hi - lo, 1e-6)
    return lo - pad, hi + pad


def lr_finder_curve(t: StudyTables) -> go.Figure | None:
    """The LR range test: raw and smoothed loss against lr (log), the suggestion marked. None
    when the study ran none."""
    df = t.lr_finder
    if df.empty:
        return None
    info = t.lr_finder_info
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=df["lr"], y=df["loss"], mode="lines", name="loss", opacity=0.35,
                             line=dict(color="#7f7f7f")))
    fig.add_trace(go.Scatter(x=df["lr"], y=df["smoothed"], mode="lines", name="smoothed loss",
                             line=dict(color=STATE_COLORS["COMPLETE"], width=3)))
    fig.update_xaxes(type="log", title="learning rate")
    ylo, yhi = _loss_range(df)
    fig.update_yaxes(title="training loss", range=[ylo, yhi])
    suggestion = info.get("suggestion")
    if suggestion:
        # A trace, not a shape: legend entry and hover, and no log-axis coordinate conventions to get wrong.
        fig.add_trace(go.Scatter(x=[suggestion, suggestion], y=[ylo, yhi], mode="lines",
                                 name=f"suggestion {suggestion:.3g} ({info.get('rule', '')})",
                                 line=dict(color="#d62728", dash="dash", width=2)))
    narrowed = info.get("narrowed")
    if narrowed:
        fig.add_trace(go.Scatter(x=[narrowed[0], narrowed[0], narrowed[1], narrowed[1], narrowed[0]],
                                 y=[ylo, yhi, yhi, ylo, ylo], fill="toself", mode="lines", line=dict(width=0),
                                 fillcolor="rgba(44,160,44,0.12)", name="narrowed lr search range"))
    return _layout(fig, "LR range test (before the trials)")


def state_counts(t: StudyTables) -> go.Figure:
    df = t.state_counts
    if df.empty:
        return _empty("Trials by state", "the study has no trials yet")
    fig = go.Figure(go.Bar(x=df["state"], y=df["count"], text=df["count"], textposition="auto",
                           marker_color=[STATE_COLORS.get(s, "#7f7f7f") for s in df["state"]]))
    return _layout(fig, "Trials by state", yaxis_title="trials", height=320)


def trial_durations(t: StudyTables) -> go.Figure:
    df = t.trials[t.trials["duration_s"].notna()]
    if df.empty:
        return _empty("Time per trial", "no trial has finished yet")
    fig = go.Figure()
    for state, sub in df.groupby("state", sort=False):
        fig.add_trace(go.Bar(x=sub["number"], y=sub["duration_s"], name=str(state).lower(),
                             marker_color=STATE_COLORS.get(str(state), "#7f7f7f"),
                             hovertemplate="trial %{x}: %{y:.1f}s<extra></extra>"))
    return _layout(fig, "Time per trial", xaxis=_trial_axis(df["number"]), yaxis_title="seconds", height=320,
                   barmode="overlay")


FIGURES = {  # div id -> builder, in page order (the LR finder may return None: not run)
    "fig-history": optimization_history,
    "fig-parallel": parallel_coordinates,
    "fig-importances": param_importances,
    "fig-pair": param_pair,
    "fig-curves": learning_curves,
    "fig-lr-finder": lr_finder_curve,
    "fig-states": state_counts,
    "fig-durations": trial_durations,
}


def all_figures(t: StudyTables) -> dict[str, go.Figure | None]:
    figures = {div_id: build(t) for div_id, build in FIGURES.items()}
    if t.objectives:  # several objectives: the front first; one objective: as before
        return {"fig-front": pareto_figure(t.trials, t.objectives, t.param_names), **figures}
    return figures


# ---- the Pareto front --------------------------------------------------------------------------
def front_points(trials: pd.DataFrame, objectives: list[tuple[str, str]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(front, dominated): the completed trials with every objective's value, the front sorted by
    the second objective (the order its steps are drawn in)."""
    cols = [f"objective:{m}" for m, _ in objectives]
    done = trials[(trials["state"] == "COMPLETE")].dropna(subset=cols)
    front = done[done["on_front"]].sort_values(cols[1] if len(cols) > 1 else cols[0])
    return front, done[~done["on_front"]]


def pareto_figure(trials: pd.DataFrame, objectives: list[tuple[str, str]], param_names: list[str]) -> go.Figure | None:
    if len(objectives) < 2:
        return None
    front, dominated = front_points(trials, objectives)
    title = "Pareto front: " + " vs ".join(f"{m} ({d})" for m, d in objectives)
    if len(objectives) == 2:
        (y_m, _), (x_m, _) = objectives
        fig = go.Figure()
        for df, name, color, mode in ((dominated, "dominated", DOMINATED_COLOR, "markers"),
                                      (front, "Pareto front", FRONT_COLOR, "lines+markers")):
            hover = [f"trial {int(r['number'])}<br>" + "<br>".join(f"{n}={r[n]}" for n in param_names)
                     for _, r in df.iterrows()]
            fig.add_trace(go.Scatter(x=df[f"objective:{x_m}"], y=df[f"objective:{y_m}"], mode=mode, name=name,
                                     marker=dict(color=color, size=10), line=dict(shape="hv", color=color),
                                     text=hover, hoverinfo="text+x+y"))
        fig.update_layout(title=title, xaxis_title=x_m, yaxis_title=y_m, template="plotly_white", height=420)
        return fig
    done = pd.concat([dominated, front])
    dims = [dict(label=m, values=done[f"objective:{m}"]) for m, _ in objectives]
    line = dict(color=done["on_front"].astype(int), colorscale=[[0, DOMINATED_COLOR], [1, FRONT_COLOR]],
                cmin=0, cmax=1)
    fig = go.Figure(go.Parcoords(dimensions=dims, line=line))
    fig.update_layout(title=title + " (front in colour)", template="plotly_white", height=420)
    return fig
