"""Draw the Pareto front of a finished study of several objectives to a PNG (the README's
picture of studies/digits_accuracy_latency.yaml).

From the folder the study ran in (its runs/ is there), after `sweeps run SPEC`::

    .venv/bin/python -m scripts.pareto_figure studies/digits_accuracy_latency.yaml \\
        --out docs/img/digits_front.png

The points come from the same table `sweeps status --format json` and the report read
(dashboards.tables.trials_table: the front is sweeps.pareto's, from the stored values): the front
in colour, joined by its steps, the dominated trials grey, each labelled with its searched
parameters. Plotly's static export needs kaleido, which the project does not install, so the PNG
is drawn with matplotlib; without matplotlib the script writes the report's plotly figure as
HTML next to the asked path and says so.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dashboards.figures import DOMINATED_COLOR, FRONT_COLOR, front_points, pareto_figure
from dashboards.tables import param_names, trials_table


def _label(row, names: list[str]) -> str:
    short = {n: n.removeprefix("task.") for n in names}
    return ", ".join(f"{short[n]}={row[n]:.3g}" if isinstance(row[n], float) else f"{short[n]}={row[n]}"
                     for n in names)


def draw_png(trials, objectives: list[tuple[str, str]], names: list[str], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    (y_m, y_d), (x_m, x_d) = objectives[:2]
    front, dominated = front_points(trials, objectives)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ax.scatter(dominated[f"objective:{x_m}"], dominated[f"objective:{y_m}"], color=DOMINATED_COLOR, s=30,
               label=f"dominated ({len(dominated)})", zorder=2)
    ax.step(front[f"objective:{x_m}"], front[f"objective:{y_m}"], where="post", color=FRONT_COLOR, zorder=3)
    ax.scatter(front[f"objective:{x_m}"], front[f"objective:{y_m}"], color=FRONT_COLOR, s=60,
               label=f"Pareto front ({len(front)})", zorder=4)
    for _, row in front.iterrows():
        ax.annotate(f"#{int(row['number'])} {_label(row, names)}", (row[f"objective:{x_m}"], row[f"objective:{y_m}"]),
                    textcoords="offset points", xytext=(6, -12), fontsize=7)
    ax.set_xlabel(f"{x_m} ({x_d})")
    ax.set_ylabel(f"{y_m} ({y_d})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from sweeps.backends.by_name import get_backend
    from sweeps.spec.load import load_spec

    p = argparse.ArgumentParser(prog="python -m scripts.pareto_figure", description=__doc__.splitlines()[0])
    p.add_argument("spec", help="study spec YAML file of a finished study with several objectives")
    p.add_argument("--out", default="docs/img/digits_front.png", help="PNG to write")
    a = p.parse_args(argv)
    spec = load_spec(a.spec)
    objectives = [(o.metric, o.direction) for o in spec.objective_list()]
    if len(objectives) < 2:
        print(f"{a.spec}: one objective ({objectives[0][0]}); a front needs objectives: [...] with two or more",
              file=sys.stderr)
        return 2
    result = get_backend(spec.backend, a.spec).load(spec)
    names = param_names(result, spec.search)
    trials = trials_table(result, spec.search)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = f"{spec.name}: {len(trials)} trials, {int(trials['on_front'].sum())} on the front"
    try:
        draw_png(trials, objectives, names, title, out)
    except ImportError:
        html = out.with_suffix(".html")
        fig = pareto_figure(trials, objectives, names)
        assert fig is not None  # two or more objectives
        fig.write_html(html)
        print(f"matplotlib is not installed: wrote {html} (the report's figure) instead of {out}")
        return 0
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
