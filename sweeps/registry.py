"""``sweeps promote``: register a study's best trial in the MLflow model registry.

The order of the writes is what makes it safe to run again after a crash:
1. pick the candidate (read only) and compare it with the alias holder (refuse a worse one);
2. log the PyTorch model into the candidate's own run (artifact name ``model``), with a
   signature, an input example and, as extra files, the trial's ONNX model re-verified
   against it plus the parity report (a logged model left by a crash is reused);
3. create the model version with the lineage tags (a version of the same run is reused);
4. move the alias, LAST: until then the old holder keeps it.

Selection rule: the study objective by default, or ``--metric M`` read from the trial runs'
metric history: the best per-epoch value of M, maximised or minimised (``--direction``; by
default the study direction when M is the objective, minimise for names with loss, error,
time, mem, latency or diff, else maximise). The weights are always the trial's best checkpoint
(``checkpoints/best.pt``, best epoch of the study objective). Trials whose ONNX parity check
failed (tag ``sweeps.onnx_parity_passed=false``) are skipped. On a tie the current holder
stays; otherwise the lower trial number wins.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from sweeps.compare import best_over_epochs, metric_curve, open_client, side_by_side
from sweeps.errors import BadNameError, PromoteError, PromoteRefused, SweepsError
from sweeps.safe_names import safe_component
from sweeps.tracking import layout
from sweeps.tracking.reader import TrackingReader

MODEL_ARTIFACT = "model"  # the logged model's name in the trial's run
TAG_RUN_ID = "sweeps.run_id"  # on a model version: the trial run it came from
TAG_PARAMS = "sweeps.params"
TAG_METRIC, TAG_METRIC_VALUE, TAG_METRIC_DIRECTION = "sweeps.metric", "sweeps.metric_value", "sweeps.metric_direction"
TAG_PROMOTED = "sweeps.promoted"  # "true" on logged models written by promote
ONNX_TAGS = ("sweeps.onnx", "sweeps.onnx_max_abs_diff", "sweeps.onnx_tolerance", "sweeps.onnx_sha256")
EXAMPLE_ROWS = 8  # rows of the input example stored with the model
CHECK_ROWS = 256  # validation inputs the ONNX re-verification runs on
_LOWER_IS_BETTER = re.compile(r"loss|error|err$|time|mem|latency|diff", re.IGNORECASE)


@dataclass
class Candidate:
    number: int
    run_id: str
    params: dict
    value: float  # only trials with a finite value are candidates
    run: Any = None  # the mlflow Run


@dataclass
class Holder:
    version: Any  # ModelVersion holding the alias
    value: float | None
    params: dict


def metric_direction(metric: str, spec, explicit: str | None = None) -> str:
    """The direction for judging ``metric`` (see the module docstring)."""
    if explicit:
        return explicit
    if metric == spec.objective.metric:
        return spec.objective.direction
    return "minimize" if _LOWER_IS_BETTER.search(metric) else "maximize"


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
        else:
            value = best_over_epochs(metric_curve(reader, t.run_id, metric), direction)
        if value is None or math.isnan(value):
            notes.append(f"trial {t.number} skipped: its run has no per-epoch values of {metric!r}")
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
        value = best_over_epochs(metric_curve(reader, mv.run_id, metric), direction)
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
def _download(reader: TrackingReader, run_id: str, path: str, dest: str) -> Path | None:
    try:
        return reader.download_artifact(run_id, path, dest)
    except Exception:  # noqa: BLE001 - missing artifact: the caller decides what that means
        return None


def build_model(reader: TrackingReader, spec, cand: Candidate, tmp: str):
    """The trial's model with its best weights, on CPU in eval mode, and its task."""
    from core.checkpoint import load_checkpoint, strip_prefixes
    from sweeps.rerun import load_resolved_config, task_from_resolved

    try:
        resolved = load_resolved_config(reader, cand.run_id)
        task = task_from_resolved(resolved)
    except SweepsError:
        resolved, task = {}, spec.make_task(cand.params)  # older runs: the spec as it is now
    ckpt = _download(reader, cand.run_id, f"{layout.ART_CHECKPOINT_DIR}/best.pt", tmp)
    if ckpt is None:
        raise PromoteError(f"trial {cand.number} (run {cand.run_id}) has no {layout.ART_CHECKPOINT_DIR}/best.pt "
                           "artifact; nothing to register")
    model = task.build_model()
    model.load_state_dict(strip_prefixes(load_checkpoint(ckpt)["model"]))
    return model.cpu().float().eval(), task, resolved


def example_inputs(task) -> Any:
    """Real validation inputs (float32, N x C x H x W) when the task can load them, else
    seeded random inputs of the task's input shape."""
    import numpy as np
    import torch

    with contextlib.suppress(Exception):
        _, val = task.datasets()
        n = min(CHECK_ROWS, len(val))
        if n > 0:
            return torch.stack([val[i][0] for i in range(n)]).float().numpy()
    if not task.input_shape:
        raise PromoteError(f"task {task.name!r} gives neither validation data nor input_shape; cannot build an "
                           "input example")
    return np.random.default_rng(0).standard_normal((EXAMPLE_ROWS, *task.input_shape)).astype(np.float32)


def verify_onnx(onnx_path: Path, model, inputs, tolerance: float, original_report: dict | None) -> dict:
    """Run the ONNX model in onnxruntime on ``inputs`` and compare with the PyTorch model."""
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    got = session.run(None, {name: inputs})[0]
    with torch.inference_mode():
        ref = model(torch.from_numpy(inputs)).numpy()
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    max_diff = float(diff.max()) if got.shape == ref.shape and np.isfinite(diff).all() else math.inf
    return {"passed": max_diff <= tolerance, "max_abs_diff": max_diff, "tolerance": tolerance,
            "n_inputs_checked": int(len(inputs)), "input_example_rows": min(EXAMPLE_ROWS, len(inputs)),
            "argmax_agree": bool(got.shape == ref.shape and (got.argmax(1) == ref.argmax(1)).all()),
            "onnx_sha256": hashlib.sha256(onnx_path.read_bytes()).hexdigest(),
            "verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "original_report": original_report}


def _pip_requirements() -> list[str]:
    import importlib.metadata

    out = []
    for pkg in ("torch", "numpy", "cloudpickle"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{pkg}=={importlib.metadata.version(pkg).split('+')[0]}")
    return out


@contextlib.contextmanager
def _fluent_uri(uri: str):
    """Point MLflow's fluent API at ``uri`` for a moment: ``log_model`` and the SQL registry
    store (which looks the logged model up to create a version) read it, not the client's."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield


def find_logged_model(registry, cand: Candidate):
    """A complete logged model written by an earlier promote of this run (crash recovery)."""
    found = registry.search_logged_models([cand.run.info.experiment_id], filter_string=(
        f"source_run_id = '{cand.run_id}' AND name = '{MODEL_ARTIFACT}'"))
    done = [m for m in found if m.tags.get(TAG_PROMOTED) == "true" and str(m.status).endswith("READY")]
    return max(done, key=lambda m: m.creation_timestamp) if done else None


def log_model(reader: TrackingReader, uri: str, spec, cand: Candidate, console) -> tuple[str, str, dict]:
    """Log the candidate's model into its run; returns (model uri, model id, ONNX tags)."""
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    with tempfile.TemporaryDirectory(prefix="sweeps-promote-") as tmp:
        model, task, resolved = build_model(reader, spec, cand, tmp)
        inputs = example_inputs(task)
        example = inputs[:EXAMPLE_ROWS]
        with torch.inference_mode():
            signature = infer_signature(example, model(torch.from_numpy(example)).numpy())
        extra, onnx_tags = [], {"sweeps.onnx": "absent"}
        onnx = _download(reader, cand.run_id, f"{layout.ART_ONNX_DIR}/model.onnx", tmp)
        if onnx is not None:
            report_path = _download(reader, cand.run_id, f"{layout.ART_ONNX_DIR}/onnx_parity.json", tmp)
            original = json.loads(report_path.read_text()) if report_path is not None else None
            tolerance = float((resolved.get("train") or {}).get("onnx_tolerance")
                              or (original or {}).get("tolerance") or 1e-4)
            report = verify_onnx(onnx, model, inputs, tolerance, original)
            if not report["passed"]:
                raise PromoteError(f"the ONNX model of trial {cand.number} (run {cand.run_id}) fails re-verification: "
                                   f"max |onnxruntime - torch| = {report['max_abs_diff']:.3g} > tolerance "
                                   f"{tolerance:.3g} over {report['n_inputs_checked']} inputs; not promoted")
            verified = Path(tmp) / "onnx_parity.json"
            verified.write_text(json.dumps(report, indent=2))
            extra = [str(onnx), str(verified)]
            onnx_tags = {"sweeps.onnx": "extra_files/model.onnx", "sweeps.onnx_tolerance": repr(tolerance),
                         "sweeps.onnx_max_abs_diff": repr(report["max_abs_diff"]),
                         "sweeps.onnx_sha256": report["onnx_sha256"]}
            console.print(f"ONNX re-verified: max |onnxruntime - torch| = {report['max_abs_diff']:.3g} <= "
                          f"{tolerance:.3g} over {report['n_inputs_checked']} inputs", markup=False, highlight=False)
        with _fluent_uri(uri):  # log_model reads the fluent URI; the run is addressed by id
            logged = reader.registry.create_logged_model(cand.run.info.experiment_id, name=MODEL_ARTIFACT,
                                                         source_run_id=cand.run_id,
                                                         tags={TAG_PROMOTED: "true", **onnx_tags})
            info = mlflow.pytorch.log_model(model, name=MODEL_ARTIFACT, model_id=logged.model_id, run_id=cand.run_id,
                                            signature=signature, input_example=example, extra_files=extra or None,
                                            pip_requirements=_pip_requirements())
    return info.model_uri, info.model_id, onnx_tags


def lineage_tags(reader, cand: Candidate, result, metric: str, direction: str, onnx_tags: dict) -> dict[str, str]:
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
            **{k: str(v) for k, v in onnx_tags.items()}}


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


# ---- the command -------------------------------------------------------------------------------
def promote(spec, *, alias: str = "champion", model_name: str | None = None, metric: str | None = None,
            direction: str | None = None, dry_run: bool = False, force: bool = False, console=None) -> int:
    from rich.console import Console

    from sweeps.backends import get_backend

    console = console or Console()
    name = check_model_name(model_name or spec.name)
    check_alias(alias)
    uri = spec.tracking_store_uri()
    reader = open_client(uri)
    result = get_backend(spec.backend).load(spec)
    metric = metric or spec.objective.metric
    direction = metric_direction(metric, spec, direction)
    ranked, notes = rank_trials(reader, result, metric, direction, spec.objective.metric)
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
                 else [f"re-verify the ONNX model of run {cand.run_id} and log the PyTorch model into it as "
                       f"{MODEL_ARTIFACT!r}", f"create a new version of registered model {name!r} with lineage tags"])
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
                  f"{metric}={cand.value:.6g}, run {cand.run_id})\nload it with: "
                  f"mlflow.pyfunc.load_model('models:/{where}') (MLFLOW_TRACKING_URI={uri})",
                  markup=False, highlight=False)
    return 0


def _register(reader, uri: str, spec, result, cand: Candidate, name: str, metric: str, direction: str, console):
    logged = find_logged_model(reader.registry, cand)
    if logged is not None:
        model_uri, model_id = f"models:/{logged.model_id}", logged.model_id
        onnx_tags = {k: v for k, v in logged.tags.items() if k in ONNX_TAGS}
        console.print(f"reusing the model logged into run {cand.run_id} by an earlier promote ({model_id})",
                      markup=False, highlight=False)
    else:
        model_uri, model_id, onnx_tags = log_model(reader, uri, spec, cand, console)
    ensure_registered_model(reader.registry, name, result.name)
    with _fluent_uri(uri):
        return reader.registry.create_model_version(
            name, source=model_uri, run_id=cand.run_id, model_id=model_id,
            tags=lineage_tags(reader, cand, result, metric, direction, onnx_tags),
            description=f"trial {cand.number} of study {result.name}")
