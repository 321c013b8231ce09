"""What ``sweeps run`` shows: a rich live view on a terminal, plain lines elsewhere.

Both read the study storage (never the workers' output), so the view is the same
whichever worker, machine or backend ran a trial.
"""
from __future__ import annotations

import sys
import time
from typing import cast

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sweeps.backends.base import StudyResult, TrialRecord
from sweeps.program import sweeps_command
from sweeps.spec.model import StudySpec


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _fmt_params(params: dict) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items()))


class LiveView:
    def __init__(self, spec: StudySpec, study_name: str, quiet: bool = False, recovered: list[int] | None = None,
                 console: Console | None = None, note: str = "") -> None:
        self.spec, self.study_name = spec, study_name
        self.console = console or Console(stderr=False)
        self.plain = quiet or not sys.stdout.isatty()
        self.started = time.monotonic()
        self._seen: set[int] = set()
        self._live: Live | None = None
        if recovered:
            self.console.print(f"recovered {len(recovered)} orphaned trial(s) {recovered}: marked FAIL, "
                               "their parameters requeued to resume from their checkpoints")
        if note:  # e.g. what a warm start carried over
            self.console.print(note, markup=False, highlight=False)
        if not self.plain:
            self._live = Live(self._render_empty(), console=self.console, refresh_per_second=2, transient=True)
            self._live.start()

    def _render_empty(self):
        return Text(f"study {self.study_name}: starting workers...")

    def update_result(self, result: StudyResult) -> None:
        new = [t for t in sorted(result.trials, key=lambda t: t.number)
               if t.state in ("COMPLETE", "PRUNED", "FAIL") and t.number not in self._seen]
        # [k/n] counts the trials that used the budget (complete or pruned), line by line: when
        # several ended since the last poll, each gets its own k rather than all the total.
        k = len(result.finished()) - sum(t.state != "FAIL" for t in new)
        for t in new:
            self._seen.add(t.number)
            k += t.state != "FAIL"
            if self.plain:
                extra = f" ({t.reason})" if t.reason and t.state != "COMPLETE" else ""
                extra += f" [{t.pack}]" if t.pack else ""  # resources.pack: trained with which trials, or why alone
                print(f"trial {t.number} {t.state} {result.metric}={_fmt(t.value)} "
                      f"in {t.duration_s or 0:.1f}s [{k}/{self.spec.budget.n_trials}] "
                      f"{_fmt_params(t.params)}{extra}", flush=True)
        if self._live is not None:
            self._live.update(self._render(result))

    def _render(self, result: StudyResult):
        n_total = self.spec.budget.n_trials
        n_done = len(result.finished())
        elapsed = time.monotonic() - self.started
        best = result.best()
        per_trial = elapsed / n_done if n_done else None
        eta = f"{per_trial * max(n_total - n_done, 0) / max(len(self._running(result)), 1):.0f}s" if per_trial else "?"
        head = Text.assemble(
            (f"study {self.study_name}", "bold"), f"  trials {n_done}/{n_total}",
            f"  best {result.metric}={_fmt(best.value if best else None)}",
            f" (trial {best.number})" if best else "", f"  elapsed {elapsed:.0f}s  ETA {eta}")
        table = Table(show_header=True, header_style="bold", box=None)
        packing = self.spec.resources.pack_size() > 1
        for col in ("trial", "epoch", result.metric, "params", *(("pack",) if packing else ())):
            table.add_column(col)
        for t in self._running(result):
            epoch = max(t.intermediate) if t.intermediate else 0
            value = t.intermediate.get(epoch) if t.intermediate else None
            table.add_row(str(t.number), f"{epoch}/{self.spec.resolved_train_config().epochs}", _fmt(value),
                          _fmt_params(t.params), *((t.pack,) if packing else ()))
        return Group(head, table)

    @staticmethod
    def _running(result: StudyResult) -> list[TrialRecord]:
        return [t for t in result.trials if t.state == "RUNNING"]

    def finish(self, result: StudyResult) -> None:
        if self._live is not None:
            self._live.stop()
        print_summary(self.spec, result, self.console)


def results_table(result: StudyResult, top: int | None = None, title: str | None = None) -> Table:
    """Trials sorted best first (finished ones), then the rest by number; the best marked."""
    best = result.best()
    reverse = result.direction == "maximize"
    several = len(result.objectives()) > 1
    # Several objectives: the Pareto front's trials first, marked "front", then the rest by number.
    ranked = (result.front() if several else
              sorted([t for t in result.trials if t.state == "COMPLETE" and t.value is not None],
                     key=lambda t: cast(float, t.value), reverse=reverse))
    ranked = sorted(ranked, key=lambda t: cast(float, t.value), reverse=reverse) if several else ranked
    others = sorted([t for t in result.trials if t not in ranked], key=lambda t: t.number)
    rows = ranked[:top] if top else ranked + others
    table = Table(title=title, header_style="bold")
    metrics = [m for m, _ in result.objectives()] if several else [result.metric]
    for col in ("", "trial", "state", *metrics, "duration", "params", "MLflow run"):
        table.add_column(col, overflow="fold")  # a narrow terminal wraps a value, never cuts it to "..."
    for t in rows:
        mark = ("front" if t in ranked else "") if several else (
            "*" if best is not None and t.number == best.number else "")
        values = [_fmt(v) for v in t.values] if several and t.values else (
            ["-"] * len(metrics) if several else [_fmt(t.value)])
        table.add_row(mark, str(t.number), t.state, *values,
                      f"{t.duration_s:.1f}s" if t.duration_s else "-", _fmt_params(t.params), t.run_id or "-")
    return table


SUMMARY_TOP = 5  # the end of a run lists this many trials, best first


def print_summary(spec: StudySpec, result: StudyResult, console: Console | None = None) -> None:
    console = console or Console()
    run = sweeps_command()
    spec_path = spec.path or "<spec>"
    counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(result.counts().items()))
    ranked = len(result.front()) if len(result.objectives()) > 1 else sum(
        t.state == "COMPLETE" and t.value is not None for t in result.trials)
    shown = f"; the best {SUMMARY_TOP} of {ranked} shown (all: status)" if ranked > SUMMARY_TOP else ""
    console.print(results_table(result, top=SUMMARY_TOP, title=f"study {result.name}: {counts}{shown}"))
    if result.stopped_reason:
        console.print(f"[yellow]{result.stopped_reason}[/yellow]")
    best = result.best()
    uri = spec.tracking_uri()
    ui = f"mlflow ui --backend-store-uri {uri}" if not uri.startswith("http") else f"open {uri}"
    console.print("next:")
    console.print(f"  look at the runs:   {ui}   (experiment {spec.experiment_name()!r})", soft_wrap=True)
    console.print(f"  study status:       {run} status {spec_path}", soft_wrap=True)
    front = result.front() if len(result.objectives()) > 1 else []
    if front:  # several objectives: no single best; promote picks from the front by a condition
        (first, d1), (second, d2) = result.objectives()[:2]
        seconds = [cast(list[float], t.values)[1] for t in front]
        # repr: the exact stored value; a rounded bound could fall on the wrong side of a front member
        where = f"{second}<={max(seconds)!r}" if d2 == "minimize" else f"{second}>={min(seconds)!r}"
        console.print(f"  Pareto front:       trials {', '.join(str(t.number) for t in front)}", markup=False)
        console.print(f"  promote from it:    {run} promote {spec_path} --where \"{where}\" "
                      f"--{d1} {first}   (tighten the bound to trade {first} for {second})",
                      markup=False, highlight=False, soft_wrap=True)
    if best is not None:
        console.print(f"  best trial {best.number}: {result.metric}={best.value:.4f}")
        console.print(f"  promote it:         {run} promote {spec_path}", soft_wrap=True)
        console.print(f"  rerun it:           {run} rerun {spec_path} --trial {best.number}", soft_wrap=True)
        console.print(f"  report:             {run} report {spec_path}", soft_wrap=True)
