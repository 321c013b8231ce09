"""Tables of one study, built from the study storage (``Backend.load``) and MLflow.

Every figure of the report is drawn from these tables, and ``sweeps status --format``
prints :func:`trials_table`; so tests check numbers here, not pixels. The tables that need
only the :class:`~sweeps.backends.base.StudyResult` live in this module; the two read from
MLflow (learning curves, LR-finder curve) live in :mod:`dashboards.mlflow_tables`.

Conventions: one row per trial (or per trial and epoch), sorted by trial number; a trial's
``value`` is the objective at the trial's best epoch (the checkpoint promote registers), for
completed and pruned trials alike; "best" means the best COMPLETE trial, as in ``StudyResult.best``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd

from dashboards import mlflow_tables as mt
from sweeps.backends.base import StudyResult
from sweeps.spec.search_space import optuna_distributions

STATE_ORDER = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")
FINISHED_STATES = ("COMPLETE", "PRUNED", "FAIL")
TRIAL_COLUMNS = ("number", "state", "value")  # then one column per parameter, then TRIAL_TAIL
TRIAL_TAIL = ("duration_s", "run_id", "is_best", "reason")
FIGURE_COLUMNS = ("onnx_latency_ms", "onnx_latency_p95_ms", "onnx_latency_spread_ms", "params", "onnx_size_bytes")
IMPORTANCE_MIN_TRIALS = 2  # fANOVA needs at least two trials with a finite value
# Fewer completed trials than this, and the importances also use pruned trials, compared at an
# epoch they all reached: two or three points say little about two parameters.
IMPORTANCE_ENOUGH_COMPLETE = 4


@dataclass
class StudyTables:
    """Everything the report draws. ``param_names`` is the order of the parameter columns;
    ``param_kinds`` says how to draw each axis: ``log``, ``linear`` or ``categorical``."""

    study: str
    backend: str
    metric: str
    direction: str
    param_names: list[str]
    param_kinds: dict[str, str]
    trials: pd.DataFrame
    best_so_far: pd.DataFrame
    state_counts: pd.DataFrame
    importances: pd.DataFrame
    curves: pd.DataFrame
    lr_finder: pd.DataFrame
    lr_finder_info: dict[str, Any] = field(default_factory=dict)  # rule, suggestion, narrowed; {} if none
    importance_note: str = ""  # the trials and value the importances come from, or why there are none
    # Several objectives: [(metric, direction), ...]; trials then has objective:<metric> and on_front.
    objectives: list[tuple[str, str]] = field(default_factory=list)

    def best_row(self) -> pd.Series | None:
        best = self.trials[self.trials["is_best"]]
        return None if best.empty else best.iloc[0]


def param_names(result: StudyResult, search: dict | None = None) -> list[str]:
    """The spec's search keys in spec order, then any other key a trial carries (sorted)."""
    names = list(search or {})
    extra = sorted({k for t in result.trials for k in t.params} - set(names))
    return names + extra


def param_kinds(search: dict | None, names: list[str], trials: pd.DataFrame | None = None) -> dict[str, str]:
    """``log`` | ``linear`` | ``categorical`` per parameter (from the spec; guessed from the values
    of a parameter the spec does not name: numbers are linear, anything else categorical)."""
    out: dict[str, str] = {}
    for name in names:
        p = (search or {}).get(name)
        if p is not None:
            out[name] = "categorical" if p.type == "categorical" else ("log" if p.log else "linear")
        elif trials is not None and name in trials and pd.api.types.is_numeric_dtype(trials[name]):
            out[name] = "linear"
        else:
            out[name] = "categorical"
    return out


def trials_table(result: StudyResult, search: dict | None = None) -> pd.DataFrame:
    """One row per trial: number, state, value, one column per parameter, duration_s, run_id,
    is_best (the best COMPLETE trial), reason (why it failed or was pruned, when known)."""
    names = param_names(result, search)
    best = result.best()
    # Several objectives: one column per objective and on_front (the Pareto front of the stored
    # values, sweeps.pareto), after the parameters; a one-objective table is unchanged.
    metrics = [m for m, _ in result.objectives()] if len(result.objectives()) > 1 else []
    front = {t.number for t in result.front()} if metrics else set()
    # The deployment figures beside the objectives: latency is shown with its p95 and spread.
    shown = [k for k in FIGURE_COLUMNS if metrics and any(k in t.figures for t in result.trials)]
    rows = []
    for t in sorted(result.trials, key=lambda t: t.number):
        row: dict[str, Any] = {"number": t.number, "state": t.state, "value": _float(t.value)}
        row.update({name: t.params.get(name) for name in names})
        if metrics:
            row.update({f"objective:{m}": _float(v) for m, v in zip(metrics, t.values or [math.nan] * len(metrics),
                                                                    strict=True)})
            row["on_front"] = t.number in front
            row.update({f"figure:{k}": _float(t.figures.get(k)) for k in shown})
        row.update({"duration_s": _float(t.duration_s), "run_id": t.run_id,
                    "is_best": best is not None and t.number == best.number, "reason": t.reason or ""})
        rows.append(row)
    extra = [*(f"objective:{m}" for m in metrics), *(["on_front"] if metrics else []),
             *(f"figure:{k}" for k in shown)]
    columns = [*TRIAL_COLUMNS, *names, *extra, *TRIAL_TAIL]
    df = pd.DataFrame(rows, columns=columns)
    return df.astype({"number": "int64", "value": "float64", "duration_s": "float64", "is_best": "bool",
                      **({"on_front": "bool"} if metrics else {})})


def table_records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as plain JSON-able dicts: numpy scalars as Python numbers (full precision), NaN as None."""
    out = []
    for row in df.to_dict(orient="records"):
        clean = {}
        for key, value in row.items():
            if hasattr(value, "item") and not isinstance(value, (str, bytes)):
                value = value.item()
            if isinstance(value, float) and math.isnan(value):
                value = None
            clean[str(key)] = value
        out.append(clean)
    return out


def ranked_trials(trials: pd.DataFrame, direction: str) -> pd.DataFrame:
    """``trials`` as ``sweeps status`` lists them: COMPLETE trials best first, then the rest by number."""
    complete = trials[(trials["state"] == "COMPLETE") & trials["value"].notna()]
    complete = complete.sort_values(["value", "number"], ascending=[direction != "maximize", True])
    rest = trials.drop(index=complete.index).sort_values("number")
    return pd.concat([complete, rest]).reset_index(drop=True)


def best_so_far_table(trials: pd.DataFrame, direction: str) -> pd.DataFrame:
    """One row per finished trial (by number): its value and the best COMPLETE value up to and
    including it (NaN before the first COMPLETE trial). Monotone in the study direction."""
    done = trials[trials["state"].isin(FINISHED_STATES)].sort_values("number")
    complete = done["value"].where(done["state"] == "COMPLETE")
    running = complete.cummax() if direction == "maximize" else complete.cummin()
    return pd.DataFrame({"number": done["number"].to_numpy(), "state": done["state"].to_numpy(),
                         "value": done["value"].to_numpy(), "best_so_far": running.ffill().to_numpy()})


def state_counts_table(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per state present: count, total and mean duration (seconds)."""
    rows = []
    known = [s for s in STATE_ORDER if s in set(trials["state"])]
    others = sorted(set(trials["state"]) - set(STATE_ORDER))
    for state in known + others:
        sub = trials[trials["state"] == state]
        rows.append({"state": state, "count": len(sub), "total_duration_s": float(sub["duration_s"].sum()),
                     "mean_duration_s": float(sub["duration_s"].mean()) if sub["duration_s"].notna().any()
                     else math.nan})
    return pd.DataFrame(rows, columns=["state", "count", "total_duration_s", "mean_duration_s"]).astype(
        {"count": "int64"})


def importances_table(result: StudyResult, search: dict | None, seed: int = 0) -> tuple[pd.DataFrame, str]:
    """(param, importance) by fANOVA, most important first, summing to 1; and a note: which trials
    and which value the importances were computed from, or why the table is empty.

    From the COMPLETE trials, each at its value (the objective at its best epoch) when there are
    at least :data:`IMPORTANCE_ENOUGH_COMPLETE` of them. With fewer (a pruner that stops most
    trials early leaves one or two), from every finished trial that reached a common epoch, each
    at its objective after that epoch: the deepest epoch at least that many trials reached, so
    completed and pruned trials are compared after the same training. The trials are rebuilt into
    an in-memory Optuna study (with the spec's distributions), so the importances are the same
    whichever backend ran the study."""
    empty = pd.DataFrame({"param": pd.Series(dtype="str"), "importance": pd.Series(dtype="float64")})
    if not search:
        return empty, "the study searched no parameters"
    dists = optuna_distributions(search)
    comparable = [t for t in result.trials if t.state in ("COMPLETE", "PRUNED") and set(t.params) == set(dists)
                  and _comparable(t.params, dists)]
    complete = [(t, float(t.value)) for t in comparable
                if t.state == "COMPLETE" and t.value is not None and math.isfinite(t.value)]
    used, basis, who = complete, f"its {result.metric} at its best epoch", f"{len(complete)} completed trials"
    if len(complete) < IMPORTANCE_ENOUGH_COMPLETE:
        step, at_step = _common_step(comparable, min(IMPORTANCE_ENOUGH_COMPLETE, len(comparable)))
        if step is not None and len(at_step) > len(complete):
            n_done = sum(t.state == "COMPLETE" for t, _ in at_step)
            used, basis = at_step, f"its {result.metric} after epoch {step}"
            who = (f"{len(at_step)} trials ({n_done} completed, {len(at_step) - n_done} pruned; only "
                   f"{len(complete)} completed, so epoch {step} is the deepest epoch that at least "
                   f"{min(IMPORTANCE_ENOUGH_COMPLETE, len(comparable))} trials reached)")
    if len(used) < IMPORTANCE_MIN_TRIALS:
        return empty, (f"parameter importances need at least {IMPORTANCE_MIN_TRIALS} completed trials, or "
                       f"{IMPORTANCE_MIN_TRIALS} trials that reached a common epoch; this study has "
                       f"{len(complete)} completed")
    # fANOVA explains differences in the value by differences in the parameters: with either
    # all alike there is nothing to explain (it would raise "zero total variance").
    n, metric = len(used), result.metric
    kind = "completed trials" if used is complete else "trials"
    values = [v for _, v in used]
    if len({tuple(sorted(t.params.items())) for t, _ in used}) == 1:
        return empty, (f"parameter importances are unavailable: all {n} {kind} have the same "
                       f"parameters ({_params_text(used[0][0].params)}), so none of them can explain a "
                       f"difference in {metric}")
    if len(set(values)) == 1:
        return empty, (f"parameter importances are unavailable: all {n} {kind} reached the same "
                       f"{metric} ({values[0]:g}), so there is no difference to explain")
    try:
        scores = _fanova(result.direction, dists, used, seed)
    except RuntimeError as exc:  # fANOVA's forest found no split that changes the value
        if "zero total variance" not in str(exc):
            raise
        return empty, (f"parameter importances are unavailable: fANOVA found no variance in {metric} "
                       f"that the parameters explain over the {n} {kind}")
    df = pd.DataFrame({"param": list(scores), "importance": [float(v) for v in scores.values()]})
    note = f"from {who}, each at {basis}"
    return df.sort_values(["importance", "param"], ascending=[False, True]).reset_index(drop=True), note


def _comparable(params: dict, dists: dict) -> bool:
    """Whether a trial's parameters fit the spec's distributions (a changed spec's old trials do
    not, and are not comparable): Optuna's own check, which raises ValueError."""
    import optuna

    try:
        optuna.trial.create_trial(params=params, distributions=dists, value=0.0)
    except ValueError:
        return False
    return True


def _common_step(trials: list, enough: int) -> tuple[int | None, list]:
    """The deepest epoch that at least ``enough`` (>= 1) of ``trials`` reported a finite value at,
    and those trials with that value; (None, []) when no epoch has that many."""
    steps = sorted({s for t in trials for s in t.intermediate}, reverse=True)
    for step in steps:
        at = [(t, float(t.intermediate[step])) for t in trials
              if step in t.intermediate and math.isfinite(t.intermediate[step])]
        if len(at) >= max(enough, 1):
            return step, at
    return None, []


def _fanova(direction: Literal["maximize", "minimize"], dists: dict, used: list, seed: int) -> dict[str, float]:
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" line
    try:
        rebuilt = optuna.create_study(direction=direction, sampler=optuna.samplers.RandomSampler(seed=seed))
    finally:
        optuna.logging.set_verbosity(verbosity)
    for t, value in used:
        rebuilt.add_trial(optuna.trial.create_trial(params=t.params, distributions=dists, value=value))
    return get_param_importances(rebuilt, evaluator=FanovaImportanceEvaluator(seed=seed))


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def top_two_params(tables: StudyTables) -> list[str]:
    """lr and batch_size when both were searched, else the two most important parameters
    (spec order when importances are unknown). Fewer when fewer were searched."""
    names = tables.param_names
    if "lr" in names and "batch_size" in names:
        return ["lr", "batch_size"]
    ranked = list(tables.importances["param"]) if not tables.importances.empty else []
    ordered = [p for p in ranked if p in names] + [p for p in names if p not in ranked]
    return ordered[:2]


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def build_tables(result: StudyResult, search: dict | None = None, reader: Any = None,
                 epoch_metrics: tuple[str, ...] | None = None) -> StudyTables:
    """Every table of the report. ``reader`` (a ``sweeps.tracking.reader.TrackingReader``) reads
    the learning curves and the LR-finder curve; without it the curves come from the study's
    intermediate values and the LR-finder table is empty."""
    names = param_names(result, search)
    trials = trials_table(result, search)
    importances, note = importances_table(result, search)
    metrics = epoch_metrics or mt.curve_metrics(result.metric)
    curves = mt.curves_table(result, reader, metrics)
    lr_df, lr_info = mt.lr_finder_table(reader, result.parent_run_id) if reader is not None \
        else (mt.empty_lr_finder(), {})
    return StudyTables(study=result.name, backend=result.backend, metric=result.metric,
                       direction=result.direction, param_names=names,
                       param_kinds=param_kinds(search, names, trials), trials=trials,
                       best_so_far=best_so_far_table(trials, result.direction),
                       state_counts=state_counts_table(trials), importances=importances, curves=curves,
                       lr_finder=lr_df, lr_finder_info=lr_info, importance_note=note,
                       objectives=result.objectives() if len(result.objectives()) > 1 else [])
