"""The Pareto front of a study of several objectives, drawn from its trials table
(``objective:<metric>`` and ``on_front`` columns of :func:`dashboards.tables.trials_table`).

Two objectives: a scatter of every completed trial, the front in colour joined by its steps and
the dominated trials greyed. More: a parallel-coordinates view, one line per completed trial
through its objectives, the front coloured and the rest grey. One objective: no figure (None).
The README's picture (scripts/pareto_figure.py) is drawn from the same table.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

FRONT_COLOR = "#2ca02c"
DOMINATED_COLOR = "#b0b0b0"


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
