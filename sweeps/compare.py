"""Read runs back from MLflow and compare them: params and final metrics side by side
(``sweeps compare``), and metric curves step by step (``sweeps rerun``).

Everything here only reads. Addressing is by run id through a ``TrackingReader``,
so it works on any two runs: two trials of one study, two studies, a trial and its rerun.
``sweeps compare`` also takes trial numbers (with the spec) and unique run-id prefixes, so
that whatever ``sweeps status`` prints, even an id its table cut short, can be pasted in.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from core.metrics import LOOP_METRICS
from sweeps.errors import RunLookupError
from sweeps.spec.model import DEFAULT_TRACKING_URI
from sweeps.tracking import layout
from sweeps.tracking.reader import TrackingReader
from sweeps.tracking.store_checks import check_sqlite_store

# Metrics that measure the machine, not the training: never part of a curve comparison.
TIMING_METRICS = frozenset({"samples_per_s", "epoch_time_s", "peak_mem_mb", "trial_seconds"})
# Export checks and latencies (about the exporter), and MLflow's system metrics (about the machine).
IGNORED_PREFIXES = ("onnx_", "system/")
DIFF_STYLE = "bold yellow"
DIFF_MARK = "*"


# ---- the store -------------------------------------------------------------------------------
def resolve_tracking_uri(explicit: str | None = None) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///runs/mlflow.db``."""
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def open_client(uri: str) -> TrackingReader:
    """A reader of the store at ``uri``. A local SQLite file must already exist: a reader must
    never create an empty store because it was started in the wrong folder."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise RunLookupError(
                f"tracking store {uri!r}: {path.resolve()} does not exist. Run the command in the folder "
                f"where the study ran (the one holding runs/), or pass --tracking-uri / set MLFLOW_TRACKING_URI.")
        check_sqlite_store(uri)  # truncated or not SQLite: a message, not SQLAlchemy's traceback
    return TrackingReader(uri)


# ---- curves ----------------------------------------------------------------------------------
def metric_curve(reader: TrackingReader, run_id: str, key: str) -> dict[int, float]:
    """step -> value of one metric. A step logged twice keeps its latest value."""
    points = sorted(reader.metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {int(m.step): float(m.value) for m in points}


def best_over_epochs(curve: dict[int, float], direction: str) -> float | None:
    """Best value over the per-epoch points (steps >= 1), NaNs ignored; None if there are none."""
    values = [v for s, v in curve.items() if s >= 1 and not math.isnan(v)]
    if not values:
        return None
    return max(values) if direction == "maximize" else min(values)


def compared_metric(name: str) -> bool:
    """Whether a metric is part of a curve comparison (timings and export checks are not)."""
    return name not in TIMING_METRICS and not name.startswith(IGNORED_PREFIXES)


def is_curve(name: str) -> bool:
    """A per-step (``step/...``) or per-epoch metric (see layout.py): what a comparison of curves
    is about. A final number logged once (``objective``) agreeing says little about training."""
    return name.startswith((layout.STEP_METRIC_PREFIX, "val_")) or name in LOOP_METRICS


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))  # bitwise-equal floats; NaN matches NaN


@dataclass
class MetricDiff:
    name: str
    n_original: int
    n_other: int
    common: int
    first_step: int | None = None  # first common step whose values differ
    max_abs_diff: float = 0.0
    max_step: int | None = None
    missing_steps: list[int] = field(default_factory=list)  # steps of the original the other lacks

    @property
    def identical(self) -> bool:
        return self.first_step is None and not self.missing_steps


@dataclass
class CurveComparison:
    """Every compared metric of ``original`` against ``other``, step by step."""

    original: str
    other: str
    metrics: list[MetricDiff]
    only_in_original: list[str]

    @property
    def nothing_to_compare(self) -> bool:
        """No per-step or per-epoch curve is in both runs: whatever else agrees, nothing about
        the training was compared (an original that lost its curves, a run that never trained)."""
        return not any(is_curve(m.name) for m in self.metrics)

    @property
    def identical(self) -> bool:
        return not self.nothing_to_compare and all(m.identical for m in self.metrics) and not self.only_in_original

    def largest(self) -> MetricDiff | None:
        differing = [m for m in self.metrics if m.first_step is not None]
        return max(differing, key=lambda m: (m.max_abs_diff, m.name)) if differing else None

    def first_parting(self) -> MetricDiff | None:
        """Where the curves first part: per-step curves first (finest grain), then per-epoch ones."""
        differing = [m for m in self.metrics if m.first_step is not None]
        if not differing:
            return None
        per_step = [m for m in differing if m.name.startswith(layout.STEP_METRIC_PREFIX)]
        pool = per_step or differing
        return min(pool, key=lambda m: (m.first_step, m.name))

    def verdict(self) -> str:
        if self.nothing_to_compare:
            theirs = sorted(n for n in self.only_in_original if is_curve(n))
            if theirs:
                why = f"run {self.other} has none of the original's curves ({', '.join(theirs)})"
            else:
                shared = sorted(m.name for m in self.metrics)
                why = (f"the original run {self.original} has no per-epoch or per-step metric curve"
                       + (f" (only {', '.join(shared)})" if shared else ""))
            return "nothing to compare: " + why
        if self.identical:
            n = sum(m.common for m in self.metrics)
            extra = [m.name for m in self.metrics if m.n_other > m.common]
            note = " (the rerun went on past the original's last step)" if extra else ""
            return f"identical: {len(self.metrics)} metric curves, {n} points, bitwise equal{note}"
        parts = []
        worst, first = self.largest(), self.first_parting()
        if worst is not None:
            parts.append(f"largest absolute difference {worst.max_abs_diff:.6g} in {worst.name} at step "
                         f"{worst.max_step}")
        if first is not None:
            parts.append(f"the curves part first at step {first.first_step} of {first.name}")
        missing = [m.name for m in self.metrics if m.missing_steps] + self.only_in_original
        if missing:
            parts.append("points of the original missing from the rerun: " + ", ".join(sorted(missing)))
        return "differs: " + "; ".join(parts)

    def tags(self) -> dict[str, Any]:
        """The verdict as run tags (``sweeps.rerun.*``)."""
        verdict = "nothing to compare" if self.nothing_to_compare else "identical" if self.identical else "differs"
        out: dict[str, Any] = {"sweeps.rerun.verdict": verdict,
                               "sweeps.rerun.summary": self.verdict(),
                               "sweeps.rerun.metrics_compared": len(self.metrics)}
        worst, first = self.largest(), self.first_parting()
        if worst is not None:
            out.update({"sweeps.rerun.max_abs_diff": repr(worst.max_abs_diff),
                        "sweeps.rerun.max_diff_metric": worst.name, "sweeps.rerun.max_diff_step": worst.max_step})
        if first is not None:
            out.update({"sweeps.rerun.first_diff_metric": first.name,
                        "sweeps.rerun.first_diff_step": first.first_step})
        return out

    def table(self) -> Table:
        t = Table(title=f"curves: original {self.original} vs rerun {self.other}", title_justify="left")
        for col in ("", "metric", "points", "first differing step", "max |diff|", "at step"):
            t.add_column(col)
        for m in sorted(self.metrics, key=lambda m: m.name):
            bad = not m.identical
            points = str(m.common) if m.n_original == m.n_other == m.common else f"{m.n_original}/{m.n_other}"
            t.add_row(DIFF_MARK if bad else "", m.name, points, "-" if m.first_step is None else str(m.first_step),
                      f"{m.max_abs_diff:.3g}" if m.first_step is not None else "0",
                      "-" if m.max_step is None else str(m.max_step), style=DIFF_STYLE if bad else None)
        return t


def compare_curves(reader, original: str, other: str, names: Iterable[str] | None = None) -> CurveComparison:
    """Compare every metric curve of run ``original`` with run ``other``, step by step.

    Equal means equal floats (NaN equals NaN). Steps the original has and ``other`` lacks
    count as a difference; extra steps of ``other`` (a rerun of a pruned trial trains on)
    do not. Timing metrics and ONNX export checks are left out (:func:`compared_metric`).
    """
    orig_keys = set(reader.get_run(original).data.metrics)
    other_keys = set(reader.get_run(other).data.metrics)
    wanted = sorted(k for k in (names if names is not None else orig_keys) if compared_metric(k))
    diffs, only = [], []
    for key in wanted:
        if key not in other_keys:
            only.append(key)
            continue
        a, b = metric_curve(reader, original, key), metric_curve(reader, other, key)
        common = sorted(set(a) & set(b))
        d = MetricDiff(key, len(a), len(b), len(common), missing_steps=sorted(set(a) - set(b)))
        for step in common:
            if _same(a[step], b[step]):
                continue
            if d.first_step is None:
                d.first_step = step
            gap = abs(a[step] - b[step])
            gap = math.inf if math.isnan(gap) else gap
            if d.max_step is None or gap > d.max_abs_diff:
                d.max_abs_diff, d.max_step = gap, step
        diffs.append(d)
    return CurveComparison(original, other, diffs, only)


# ---- side by side ----------------------------------------------------------------------------
def fmt_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def side_by_side(title: str, headers: tuple[str, str], sections: list[tuple[str, list[tuple[str, Any, Any]]]],
                 mark: bool = True) -> tuple[Table, int]:
    """A table of ``(key, a, b)`` rows under section headings; differing rows are coloured
    and marked (unless ``mark`` is False: nothing to compare with). Returns the table and the
    number of differing rows."""
    t = Table(title=title, title_justify="left", caption=f"rows marked {DIFF_MARK} differ" if mark else None,
              caption_justify="left")
    t.add_column("", width=1)
    t.add_column("", overflow="fold")
    t.add_column(headers[0], overflow="fold")
    t.add_column(headers[1], overflow="fold")
    n_diff = 0
    for heading, rows in sections:
        if not rows:
            continue
        t.add_row("", Text(heading, style="bold"), "", "", end_section=False)
        for key, a, b in rows:
            if isinstance(a, float) and isinstance(b, float):
                differ = mark and not _same(a, b)
            else:
                differ = mark and fmt_value(a) != fmt_value(b)
            n_diff += differ
            sa, sb = fmt_value(a), fmt_value(b)
            if differ and sa == sb:  # different floats that print alike: show them in full
                sa, sb = repr(a), repr(b)
            t.add_row(DIFF_MARK if differ else "", Text(key), Text(sa), Text(sb),
                      style=DIFF_STYLE if differ else None)
        t.add_section()
    return t, n_diff


def run_info(run) -> dict[str, Any]:
    """The few facts that say what a run is (shown above its params)."""
    tags = run.data.tags
    return {"run name": run.info.run_name, "status": run.info.status, "experiment": run.info.experiment_id,
            "study": tags.get(layout.TAG_STUDY), "trial": tags.get(layout.TAG_TRIAL_NUMBER),
            "role": tags.get(layout.TAG_ROLE), "rerun of": tags.get(layout.TAG_RERUN_OF)}


def compare_table(run_a, run_b, only_differences: bool = False) -> tuple[Table, int]:
    """Params and final metrics of two runs side by side (run info on top); ``only_differences``
    leaves out the rows where both runs agree."""
    ia, ib = run_info(run_a), run_info(run_b)
    info = [(k, ia[k], ib[k]) for k in ia if ia[k] is not None or ib[k] is not None]
    pa, pb = run_a.data.params, run_b.data.params
    params = [(k, pa.get(k), pb.get(k)) for k in sorted(set(pa) | set(pb))]
    ma, mb = run_a.data.metrics, run_b.data.metrics
    metrics = [(k, ma.get(k), mb.get(k)) for k in sorted(set(ma) | set(mb))]
    if only_differences:
        info, params, metrics = ([row for row in rows if row[1] != row[2]] for rows in (info, params, metrics))
    return side_by_side(f"compare {run_a.info.run_id} vs {run_b.info.run_id}",
                        (f"A {run_a.info.run_name or run_a.info.run_id[:8]}",
                         f"B {run_b.info.run_name or run_b.info.run_id[:8]}"),
                        [("run", info), ("params", params), ("metrics (final value)", metrics)])


# ---- addressing runs -------------------------------------------------------------------------
RUN_ID_RE = re.compile(r"[0-9a-f]{32}")
# A short all-digit ref is far likelier a trial number given without its spec than a run-id prefix.
MIN_DIGIT_PREFIX = 4
# What a table that cut a long cell leaves at its end (rich: "…"): pasted along with the id.
_CUT_MARKS = ("\u2026", "...")


def find_trial_run(reader: TrackingReader, spec, trial_number: int) -> str:
    """Run id of trial ``trial_number`` of the spec's current study version, from MLflow alone
    (so it is the same for either backend). The newest finished run wins over retries."""
    experiment_id = reader.experiment_id(spec.experiment_name())
    if experiment_id is None:
        raise RunLookupError(f"MLflow experiment {spec.experiment_name()!r} not found at {reader.tracking_uri}; "
                             f"has `sweeps run {spec.path or spec.name}` run here?")
    versions = re.compile(re.escape(spec.name) + r"(-v\d+)?")
    parents = [p for p in reader.find_runs(experiment_id, {layout.TAG_ROLE: layout.ROLE_STUDY}, max_results=200)
               if versions.fullmatch(p.data.tags.get(layout.TAG_STUDY, ""))]
    if not parents:
        raise RunLookupError(f"no study run of {spec.name!r} in experiment {spec.experiment_name()!r} at "
                             f"{reader.tracking_uri}")
    parent = parents[0]
    children = reader.children(parent.info.run_id, {layout.TAG_ROLE: layout.ROLE_TRIAL})
    match = [r for r in children if r.data.tags.get(layout.TAG_TRIAL_NUMBER) == str(trial_number)]
    if not match:
        have = sorted({int(r.data.tags[layout.TAG_TRIAL_NUMBER]) for r in children
                       if r.data.tags.get(layout.TAG_TRIAL_NUMBER, "").isdigit()})
        raise RunLookupError(f"study {parent.data.tags.get(layout.TAG_STUDY)!r} has no MLflow run for trial "
                             f"{trial_number}; trials with runs: {have or 'none'}")
    match.sort(key=lambda r: (r.info.status == "FINISHED", r.info.start_time or 0), reverse=True)
    return match[0].info.run_id


def resolve_run(reader: TrackingReader, ref: str, spec=None) -> str:
    """The full run id that ``ref`` names: a trial number of ``spec``'s study (all digits, only
    with a spec), a full run id, or a unique prefix of one (a trailing "…" that a table left is
    dropped). RunLookupError (exit 2) lists the candidates of
    an ambiguous prefix and says what to give for an unknown one."""
    text = ref.strip()
    for mark in _CUT_MARKS:
        text = text.removesuffix(mark)
    text = text.lower()
    if spec is not None and text.isdigit():
        return find_trial_run(reader, spec, int(text))
    if RUN_ID_RE.fullmatch(text):
        return text
    if not re.fullmatch(r"[0-9a-f]+", text):
        raise RunLookupError(f"{ref!r} is not a run id: give a trial number with the spec (sweeps compare SPEC 3 "
                             "7), a run id, or the start of one (its first 8 characters, as `sweeps status` shows)")
    if text.isdigit() and len(text) < MIN_DIGIT_PREFIX:
        raise RunLookupError(f"{ref!r}: trial numbers need the study spec first (sweeps compare SPEC {text} N); a "
                             f"run-id prefix of digits only needs at least {MIN_DIGIT_PREFIX} of them")
    experiments = [reader.experiment_id(spec.experiment_name())] if spec is not None else None
    found = reader.runs_with_id_prefix(text, [e for e in experiments if e] if experiments else None)
    if len(found) == 1:
        return found[0].info.run_id
    where = f"experiment {spec.experiment_name()!r} at " if spec is not None else ""
    if not found:
        raise RunLookupError(f"no MLflow run id starts with {text!r} in {where}{reader.tracking_uri}; check the id "
                             "(`sweeps status SPEC` lists the trials' runs) or the tracking URI")
    lines = [f"  {r.info.run_id}  {r.info.run_name or '-'}  study {r.data.tags.get(layout.TAG_STUDY, '-')}  trial "
             f"{r.data.tags.get(layout.TAG_TRIAL_NUMBER, '-')}" for r in found[:10]]
    more = f"\n  ... and {len(found) - 10} more" if len(found) > 10 else ""
    raise RunLookupError(f"run id prefix {text!r} is ambiguous: {len(found)} runs in {where}{reader.tracking_uri} "
                         "start with it; give more characters:\n" + "\n".join(lines) + more)


def compare_runs(reader: TrackingReader, run_a: str, run_b: str, console, spec=None,
                 only_differences: bool = False) -> int:
    """``sweeps compare``: print the table and a one-line count of the differences. ``run_a`` and
    ``run_b``: anything :func:`resolve_run` takes (trial numbers only with ``spec``)."""
    a, b = (reader.get_run(resolve_run(reader, ref, spec)) for ref in (run_a, run_b))
    table, n_diff = compare_table(a, b, only_differences)
    console.print(table)
    pa, pb = a.data.params, b.data.params
    differing = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
    console.print(Text(f"{len(differing)} of {len(set(pa) | set(pb))} params differ"
                       + (f": {', '.join(differing)}" if differing else "")))
    return 0
