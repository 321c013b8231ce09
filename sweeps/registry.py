"""``sweeps promote``: register a study's best trial in the MLflow model registry.

The order of the writes is what makes it safe to run again after a crash:
1. pick the candidate (read only) and compare it with the alias holder (refuse a worse one);
2. log the model into the candidate's own run (artifact name ``model``): a pyfunc model that
   takes the task's natural input, checked against the task's input contract, and returns
   predictions (``sweeps.serving``), with an input example in those units, the PyTorch module,
   and the trial's ONNX model re-verified against it plus the parity report (a logged model left by a crash is reused);
3. create the model version with the lineage tags (a version of the same run is reused);
4. move the alias, LAST: until then the old holder keeps it.

Selection rule: the study objective by default, or ``--metric M`` read from the trial runs'
metric history: the best per-epoch value of M, maximised or minimised (``--direction``; by
default the study direction when M is the objective, else the direction the task declares for
M (``Task.metric_directions``, the loop's own metrics), else minimise for names with loss, error,
time, mem, latency or diff and maximise the rest). The weights are always the trial's best checkpoint
(``checkpoints/best.pt``, best epoch of the study objective). Trials whose ONNX parity check
failed (tag ``sweeps.onnx_parity_passed=false``) are skipped. On a tie the current holder
stays; otherwise the lower trial number wins.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from rich.text import Text

from core.metrics import LOOP_METRICS, declared_metrics
from sweeps.backends.by_name import get_backend
from sweeps.compare import best_over_epochs, metric_curve, open_client, side_by_side
from sweeps.errors import BadNameError, NothingQualifies, PromoteError, PromoteRefused, UsageError
from sweeps.model_logging import find_logged_model, log_model, promoted_name
from sweeps.pareto import parse_where
from sweeps.safe_names import safe_component
from sweeps.spec.objectives import is_deploy_metric
from sweeps.tracking import layout
from sweeps.tracking.mlflow_adapter import fluent_uri
from sweeps.tracking.reader import TrackingReader
from sweeps.tracking.trial_model import TAG_CHECKPOINT_MODEL, TAG_MODEL_ID

TAG_RUN_ID = "sweeps.run_id"  # on a model version: the trial run it came from
TAG_PARAMS = "sweeps.params"
TAG_METRIC, TAG_METRIC_VALUE, TAG_METRIC_DIRECTION = "sweeps.metric", "sweeps.metric_value", "sweeps.metric_direction"
TAG_FIGURE_PREFIX = "sweeps.figure."  # on a model version: each objective's value and deployment figure
TAG_WHERE = "sweeps.where"  # on a model version: the --where conditions it was picked under
# Tags of the logged model that the model version carries too (and its description is made from).
MODEL_TAGS = ("sweeps.onnx", "sweeps.onnx_max_abs_diff", "sweeps.onnx_tolerance", "sweeps.onnx_sha256",
              "sweeps.onnx_preprocessing", "sweeps.input", "sweeps.input_contract", "sweeps.pytorch_format",
              "sweeps.torchscript", "sweeps.torchscript_max_abs_diff")
_LOWER_IS_BETTER = re.compile(r"loss|error|err$|time|mem|latency|diff", re.IGNORECASE)


@dataclass
class Candidate:
    number: int
    run_id: str
    params: dict
    value: float  # only trials with a finite value are candidates
    run: Any = None  # the mlflow Run
    figures: dict[str, float] = field(default_factory=dict)  # objectives and deployment figures: version tags
    where: str = ""  # the --where conditions it was picked under


@dataclass
class Holder:
    version: Any  # ModelVersion holding the alias
    value: float | None
    params: dict


def metric_direction(metric: str, spec, explicit: str | None = None) -> str:
    """The direction for judging ``metric`` (see the module docstring). An explicit direction
    that contradicts a known one (the study's objective, a deployment cost, the task's own
    metric) is refused: ``--maximize val_loss`` would register the worst model."""
    known = _known_direction(metric, spec)
    if explicit and known and explicit != known:
        better = "higher" if known == "maximize" else "lower"
        raise UsageError(f"--{explicit} {metric}: {metric} is better when {better} "
                         f"(the study's objective, a deployment cost or the task's own metric), so this would pick "
                         f"the worst trial; use --{known} {metric}")
    return explicit or known or ("minimize" if _LOWER_IS_BETTER.search(metric) else "maximize")


def _known_direction(metric: str, spec) -> str | None:
    for objective in spec.objective_list():
        if metric == objective.metric:
            return objective.direction
    if is_deploy_metric(metric):  # a deployment cost: lower is better
        return "minimize"
    with contextlib.suppress(Exception):  # a task that cannot be built here: judged by the name (caller)
        known = {**LOOP_METRICS, **(declared_metrics(spec.make_task()) or {})}.get(metric)
        if known is not None:  # the task's own direction (val_mae: minimize), not a guess from the name
            return "maximize" if known else "minimize"
    return None


def worse(a: float | None, b: float | None, direction: str) -> bool:
    """Whether value ``a`` is strictly worse than ``b`` (a missing or NaN ``a`` is worse)."""
    if b is None or math.isnan(b):
        return False
    if a is None or math.isnan(a):
        return True
    return a < b if direction == "maximize" else a > b


def check_alias(alias: str) -> str:
    """Refuse an alias MLflow would refuse, before anything is written (the alias moves last)."""
    reserved = alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias or "")
    if not re.fullmatch(r"[\w-]{1,255}", alias or "") or reserved:
        raise BadNameError(f"alias {alias!r} is refused: use letters, digits, '_' and '-' (not 'latest' and not a "
                           "version name like 'v3'), e.g. champion")
    return alias


def check_model_name(name: str) -> str:
    safe_component(name, "model name")
    if any(c in name for c in "'\"`"):
        raise BadNameError(f"model name {name!r} is refused: quotes cannot be used in MLflow registry searches")
    return name


# ---- choosing ----------------------------------------------------------------------------------
def rank_trials(reader, result, metric: str, direction: str, objective: str) -> tuple[list[Candidate], list[str]]:
    """Eligible finished trials, best first, and why the others were left out."""
    ranked, notes = [], []
    for t in result.trials:
        if t.state != "COMPLETE" or not t.run_id:
            continue
        try:
            run = reader.get_run(t.run_id)
        except Exception:  # noqa: BLE001 - a run deleted from MLflow: nothing to register from
            notes.append(f"trial {t.number} skipped: its MLflow run {t.run_id} cannot be read")
            continue
        if run.data.tags.get(layout.TAG_ONNX_PASSED) == "false":
            notes.append(f"trial {t.number} skipped: its ONNX model failed the parity check")
            continue
        if metric == objective and t.value is not None:
            value = t.value
        elif is_deploy_metric(metric):  # measured once per trial, not per epoch
            value = run.data.metrics.get(metric)
        else:
            value = best_over_epochs(metric_curve(reader, t.run_id, metric), direction)
        if value is None or math.isnan(value):
            notes.append(f"trial {t.number} skipped: its run has no " + (
                f"measured {metric!r}" if is_deploy_metric(metric) else f"per-epoch values of {metric!r}"))
            continue
        ranked.append(Candidate(t.number, t.run_id, dict(t.params), value, run))
    sign = -1.0 if direction == "maximize" else 1.0
    ranked.sort(key=lambda c: (sign * c.value, c.number))
    return ranked, notes


def current_holder(reader: TrackingReader, name: str, alias: str, metric: str, direction: str) -> Holder | None:
    from mlflow.exceptions import MlflowException

    try:
        mv = reader.registry.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None  # no such model or alias yet
    value = None
    with contextlib.suppress(Exception):  # the holder's run may be gone: fall back to its tags
        value = (reader.get_run(mv.run_id).data.metrics.get(metric) if is_deploy_metric(metric)
                 else best_over_epochs(metric_curve(reader, mv.run_id, metric), direction))
    if value is None and mv.tags.get(TAG_METRIC) == metric:
        with contextlib.suppress(ValueError, TypeError):
            value = float(mv.tags.get(TAG_METRIC_VALUE))
    params = {}
    with contextlib.suppress(ValueError, TypeError):
        params = json.loads(mv.tags.get(TAG_PARAMS) or "{}")
    return Holder(mv, value, params)


def find_version(registry, name: str, run_id: str):
    """The newest READY version of ``name`` made from run ``run_id``, if any."""
    versions = [mv for mv in registry.search_model_versions(f"name = '{name}'")
                if (mv.tags.get(TAG_RUN_ID) or mv.run_id) == run_id and mv.status == "READY"]
    return max(versions, key=lambda mv: int(mv.version)) if versions else None


def comparison_table(name: str, alias: str, metric: str, direction: str, cand: Candidate, holder: Holder | None,
                     existing) -> Any:
    hv = holder.version if holder is not None else None
    rows = [("model version", existing.version if existing is not None else "(new)", hv.version if hv else None),
            ("study", cand.run.data.tags.get(layout.TAG_STUDY), hv.tags.get(layout.TAG_STUDY) if hv else None),
            ("trial", cand.number, hv.tags.get(layout.TAG_TRIAL_NUMBER) if hv else None),
            ("run id", cand.run_id, hv.run_id if hv else None),
            (f"{metric} ({direction})", cand.value, holder.value if holder else None)]
    keys = sorted(set(cand.params) | set(holder.params if holder else {}))
    params = [(k, cand.params.get(k), holder.params.get(k) if holder else None) for k in keys]
    table, _ = side_by_side(f"promote to {name}@{alias}", ("candidate", f"current holder ({alias})"),
                            [("model", rows), ("params", params)], mark=holder is not None)
    return table


# ---- the model ---------------------------------------------------------------------------------
def lineage_tags(reader, cand: Candidate, result, metric: str, direction: str, model_tags: dict) -> dict[str, str]:
    tags = cand.run.data.tags
    commit = tags.get(layout.TAG_GIT_COMMIT)
    if not commit and tags.get(layout.PARENT_TAG):  # trials inherit the commit of the study's parent run
        with contextlib.suppress(Exception):
            commit = reader.get_run(tags[layout.PARENT_TAG]).data.tags.get(layout.TAG_GIT_COMMIT)
    return {layout.TAG_STUDY: result.name, layout.TAG_TRIAL_NUMBER: str(cand.number), TAG_RUN_ID: cand.run_id,
            TAG_PARAMS: json.dumps(cand.params, sort_keys=True), TAG_METRIC: metric,
            TAG_METRIC_VALUE: repr(cand.value), TAG_METRIC_DIRECTION: direction,
            layout.TAG_SEED: tags.get(layout.TAG_SEED, ""), layout.TAG_GIT_COMMIT: commit or "unknown",
            layout.TAG_SPEC_HASH: tags.get(layout.TAG_SPEC_HASH, ""), layout.TAG_BACKEND: result.backend,
            # The trial's own logged model (its best checkpoint, in the experiment's Models view).
            **({TAG_CHECKPOINT_MODEL: tags[TAG_MODEL_ID]} if tags.get(TAG_MODEL_ID) else {}),
            **{TAG_FIGURE_PREFIX + k: repr(v) for k, v in cand.figures.items()},
            **({TAG_WHERE: cand.where} if cand.where else {}),
            **{k: str(v) for k, v in model_tags.items()}}


def ensure_registered_model(registry, name: str, study: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        registry.get_registered_model(name)
        return
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        registry.create_registered_model(name, tags={layout.TAG_STUDY: study},
                                         description=f"Models promoted from study {study!r} by `sweeps promote`.")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # a parallel promote created it first
            raise


# ---- several objectives: --where on the front ---------------------------------------------------
def eligible(result, where: str | None):
    """``result`` narrowed to the trials promote may pick: with several objectives, the Pareto
    front of the stored values; with ``--where``, those of them (or of the COMPLETE trials, for
    one objective) meeting every condition. UsageError for a condition on a metric no trial has;
    NothingQualifies (exit 2) when no trial meets them, showing what the front offers."""
    conditions = parse_where(where) if where is not None else []  # --where "" is refused, not ignored
    metrics = [m for m, _ in result.objectives()]
    several = len(metrics) > 1
    if not (conditions or several):
        return result
    pool = result.front() if several else [t for t in result.trials if t.state == "COMPLETE"]
    known = sorted({k for t in pool for k in t.objective_values(metrics)} | set(metrics))
    for c in conditions:
        if c.metric not in known:
            raise UsageError(f"--where {where!r}: {c.metric!r} is not an objective or a deployment figure of the "
                             f"trials; use one of {', '.join(known)}")
    keep = [t for t in pool if all(c.holds(t.objective_values(metrics)) for c in conditions)]
    if not keep:
        def figures(t) -> str:
            values = t.objective_values(metrics)
            return ", ".join(f"{c.metric}={values.get(c.metric, math.nan):.4g}" for c in conditions)

        shown = "; ".join(f"trial {t.number}: {figures(t)}" for t in pool) or "no trial"
        raise NothingQualifies(f"no trial {'on the Pareto front' if several else 'of the study'} meets --where "
                               f"{', '.join(map(str, conditions))} ({shown}); nothing was changed. Relax the "
                               "conditions, or run more trials")
    return replace(result, trials=keep)


# ---- the command -------------------------------------------------------------------------------
def promote(spec, *, alias: str = "champion", model_name: str | None = None, metric: str | None = None,
            direction: str | None = None, dry_run: bool = False, force: bool = False, console=None,
            where: str | None = None) -> int:
    from rich.console import Console

    console = console or Console()
    name = check_model_name(model_name or spec.name)
    check_alias(alias)
    uri = spec.tracking_store_uri()
    reader = open_client(uri)
    result = eligible(get_backend(spec.backend).load(spec), where)
    metric = metric or spec.objective.metric
    direction = metric_direction(metric, spec, direction)
    ranked, notes = rank_trials(reader, result, metric, direction, spec.objective.metric)
    metrics = [m for m, _ in result.objectives()]
    for c in ranked:
        c.figures = next(t for t in result.trials if t.number == c.number).objective_values(metrics)
        c.where = where or ""
    for note in notes:
        console.print(note, markup=False, highlight=False)
    if not ranked:
        raise PromoteError(f"study {result.name!r} has no finished trial to promote by {metric!r} (complete, with "
                           f"a run, and not failing its ONNX parity check)")
    holder = current_holder(reader, name, alias, metric, direction)
    cand = ranked[0]
    if holder is not None:  # on a tie the holder stays: no churn between equally good models
        tied = [c for c in ranked if c.value == cand.value and c.run_id == holder.version.run_id]
        cand = tied[0] if tied else cand
    existing = find_version(reader.registry, name, cand.run_id)
    console.print(comparison_table(name, alias, metric, direction, cand, holder, existing))
    where = f"{name}@{alias}"
    if holder is not None and holder.version.run_id == cand.run_id:
        console.print(f"{where} already holds trial {cand.number} (version {holder.version.version}, run "
                      f"{cand.run_id}); nothing to do", markup=False, highlight=False)
        return 0
    if holder is not None and (holder.value is None or worse(cand.value, holder.value, direction)):
        why = (f"the current holder (version {holder.version.version}, run {holder.version.run_id}) has no value of "
               f"{metric!r} to compare with" if holder.value is None else
               f"trial {cand.number} (run {cand.run_id}) has {metric}={cand.value:.6g}, worse than the current "
               f"holder version {holder.version.version} (run {holder.version.run_id}) with "
               f"{metric}={holder.value:.6g} ({direction})")
        if not force:
            raise PromoteRefused(f"refused to move {where}: {why}. Nothing was changed; pass --force to promote "
                                 "it anyway.")
        console.print(Text(f"--force: promoting although {why}", style="yellow"))
    if dry_run:
        steps = ([f"reuse version {existing.version} of {name} (already made from run {cand.run_id})"] if existing
                 else [f"re-verify the ONNX model of run {cand.run_id} and log the model (natural input -> "
                       f"predictions) into it as {promoted_name(cand.number)!r}",
                       f"create a new version of registered model {name!r} with lineage tags"])
        steps.append(f"move alias {alias!r} to it" + (f" (from version {holder.version.version})" if holder else ""))
        console.print("dry run, nothing written; would:\n" + "\n".join(f"  - {s}" for s in steps),
                      markup=False, highlight=False)
        return 0
    if existing is None:
        existing = _register(reader, uri, spec, result, cand, name, metric, direction, console)
    else:
        console.print(f"reusing version {existing.version} of {name} (made from run {cand.run_id})",
                      markup=False, highlight=False)
    reader.registry.set_registered_model_alias(name, alias, existing.version)  # LAST: a crash keeps the holder
    console.print(f"{where} -> version {existing.version} (trial {cand.number} of study {result.name}, "
                  f"{metric}={cand.value:.6g}, run {cand.run_id})\nload it with:\n"
                  f"  import mlflow\n  mlflow.set_tracking_uri({uri!r})\n"
                  f"  model = mlflow.pyfunc.load_model('models:/{where}')\n  predictions = model.predict(x)\n"
                  f"The model {existing.tags.get('sweeps.input_contract') or 'takes what its signature says.'}",
                  markup=False, highlight=False)
    return 0


def _register(reader, uri: str, spec, result, cand: Candidate, name: str, metric: str, direction: str, console):
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS  # lazy: mlflow loads only when a model is promoted

    from sweeps.serving import description  # lazy: mlflow.pyfunc, only to describe

    logged = find_logged_model(reader.registry, cand)
    if logged is not None:
        model_uri, model_id = f"models:/{logged.model_id}", logged.model_id
        model_tags = {k: v for k, v in logged.tags.items() if k in MODEL_TAGS}
        console.print(f"reusing the model logged into run {cand.run_id} by an earlier promote ({model_id})",
                      markup=False, highlight=False)
    else:
        model_uri, model_id, model_tags = log_model(reader, uri, spec, cand, console)
    ensure_registered_model(reader.registry, name, result.name)
    with fluent_uri(uri):
        version = reader.registry.create_model_version(
            name, source=model_uri, run_id=cand.run_id, model_id=model_id,
            tags=lineage_tags(reader, cand, result, metric, direction, model_tags),
            description=description(model_tags, cand.number, result.name))
    # The Models tab links a logged model to its registered versions through this tag, which
    # mlflow.register_model sets and MlflowClient.create_model_version does not.
    linked = json.loads(reader.registry.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
    reader.registry.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        [*linked, {"name": name, "version": version.version}])})
    return version
