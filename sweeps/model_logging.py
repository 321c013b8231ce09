"""The model ``sweeps promote`` logs into a trial's run: the pyfunc model of ``sweeps.serving``
(natural input -> the task's preprocess -> the trial's best weights -> postprocess -> predictions),
with an input example in natural units, the PyTorch module itself, and the trial's
ONNX model re-verified against it (onnxruntime vs torch on validation model inputs), stamped with
what it leaves out, beside the parity report, and its TorchScript file (``train.export_torchscript``)
re-verified the same way. A logged model left by a crashed promote is found
and reused (``find_logged_model``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps.errors import ArtifactError, PromoteError, SweepsError
from sweeps.resolved_config import load_resolved_config, task_from_resolved
from sweeps.tracking import layout
from sweeps.tracking.mlflow_adapter import fluent_uri
from sweeps.tracking.reader import TrackingReader
from sweeps.tracking.trial_model import TAG_CHECKPOINT_MODEL, TAG_MODEL_ID

if TYPE_CHECKING:
    from sweeps.registry import Candidate

TAG_PROMOTED = "sweeps.promoted"  # "true" on logged models written by promote
TAG_FORMAT = "sweeps.model_format"  # their layout (sweeps.serving.MODEL_FORMAT); another one is not reused
EXAMPLE_ROWS = 8  # rows of the input example stored with the model
CHECK_ROWS = 256  # validation inputs the ONNX re-verification runs on
TORCHSCRIPT_DIR = "torchscript"  # where a trial logs model.ts (sweeps.trial's artifact folders)
ART_TORCHSCRIPT = "torchscript_model"  # its key among the pyfunc model's artifacts


def _download(reader: TrackingReader, run_id: str, path: str, dest: str) -> Path | None:
    try:
        return reader.download_artifact(run_id, path, dest)
    except Exception:  # noqa: BLE001 - missing artifact: the caller decides what that means
        return None


def build_model(reader: TrackingReader, spec, cand: Candidate, tmp: str):
    """The trial's model with its best weights, on CPU in eval mode, and its task."""
    from core.checkpoint import load_checkpoint, strip_prefixes  # lazy: torch, only to promote

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


def verify_torchscript(ts_path: Path, model, inputs, tolerance: float) -> dict:
    """Run the trial's ``model.ts`` on ``inputs`` and compare with the PyTorch model (as for ONNX)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # torch.jit is marked deprecated; the file is what is checked
        warnings.simplefilter("ignore", FutureWarning)
        loaded = torch.jit.load(str(ts_path), map_location="cpu")
    with torch.inference_mode():
        got, ref = loaded(torch.from_numpy(inputs)), model(torch.from_numpy(inputs))
    diff = (got.double() - ref.double()).abs()
    max_diff = float(diff.max()) if got.shape == ref.shape and bool(torch.isfinite(diff).all()) else math.inf
    return {"passed": max_diff <= tolerance, "max_abs_diff": max_diff, "tolerance": tolerance,
            "n_inputs_checked": int(len(inputs)),
            "torchscript_sha256": hashlib.sha256(ts_path.read_bytes()).hexdigest()}


def _add_torchscript(reader: TrackingReader, cand: Candidate, tmp: str, model, inputs, resolved: dict,
                     artifacts: dict, tags: dict, console) -> None:
    """The trial's TorchScript file (``train.export_torchscript``), re-verified, beside the ONNX one."""
    ts = _download(reader, cand.run_id, f"{TORCHSCRIPT_DIR}/model.ts", tmp)
    if ts is None:
        return
    tolerance = float((resolved.get("train") or {}).get("onnx_tolerance") or 1e-4)
    report = verify_torchscript(ts, model, inputs, tolerance)
    if not report["passed"]:
        raise PromoteError(f"the TorchScript model of trial {cand.number} (run {cand.run_id}) fails re-verification: "
                           f"max |torchscript - torch| = {report['max_abs_diff']:.3g} > tolerance {tolerance:.3g}; "
                           "not promoted")
    artifacts[ART_TORCHSCRIPT] = str(ts)
    tags.update({"sweeps.torchscript": "artifacts/model.ts",
                 "sweeps.torchscript_max_abs_diff": repr(report["max_abs_diff"])})
    console.print(f"TorchScript re-verified: max |torchscript - torch| = {report['max_abs_diff']:.3g} <= "
                  f"{tolerance:.3g}", markup=False, highlight=False)


def _pip_requirements() -> list[str]:
    import importlib.metadata

    out = []
    for pkg in ("torch", "torchvision", "numpy", "cloudpickle"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out.append(f"{pkg}=={importlib.metadata.version(pkg).split('+')[0]}")
    return out


def promoted_name(number: int) -> str:
    """The promoted model's name in the Models tab: its trial's, beside that trial's checkpoint model."""
    return f"trial-{number}-promoted"


class _PickleNotice(logging.Filter):
    """MLflow warns, at every log_model given a python_model object, that the object is pickled.
    Ours is sweeps.serving.TaskModel, a stateless class of this package (the weights travel as
    artifacts), so the warning only alarms a user promoting a model; MLflow's other lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passing a Python object as `python_model`")


@contextlib.contextmanager
def _no_pickle_notice() -> Iterator[None]:
    logger, notice = logging.getLogger("mlflow.pyfunc"), _PickleNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def find_logged_model(registry, cand: Candidate):
    """A complete logged model written by an earlier promote of this run (crash recovery)."""
    found = registry.search_logged_models([cand.run.info.experiment_id], filter_string=(
        f"source_run_id = '{cand.run_id}'"))
    from sweeps.serving import MODEL_FORMAT  # lazy: mlflow.pyfunc, only to promote

    done = [m for m in found if m.tags.get(TAG_PROMOTED) == "true" and m.tags.get(TAG_FORMAT) == MODEL_FORMAT
            and str(m.status).endswith("READY")]
    return max(done, key=lambda m: m.creation_timestamp) if done else None


def task_section(resolved: dict, spec, cand: Candidate) -> dict:
    """The trial's task section (name or target, model, args): from its resolved config, else the spec."""
    if resolved.get("task"):
        return dict(resolved["task"])
    return {"name": spec.task.name, "target": spec.task.target, "model": spec.task.model,
            "args": spec.task_args(cand.params)}


def natural_examples(task, console) -> Any:
    """The task's natural examples as a numpy array, or None (it gives none, or fails to)."""
    try:
        found = task.natural_examples(EXAMPLE_ROWS)
    except Exception as exc:  # noqa: BLE001 - a task's data may be missing here: fall back, saying why
        console.print(f"task {task.name!r} gave no natural examples ({type(exc).__name__}: {exc})",
                      markup=False, highlight=False)
        return None
    if found is None or len(found) == 0:
        return None
    return found.numpy() if hasattr(found, "numpy") else found


def unusable_onnx(uri: str, cand: Candidate, exc: Exception) -> ArtifactError:
    """The refusal of a trial whose ONNX artifacts cannot be read or run: the run, the artifact,
    the loader's own words (first line) and the two ways on."""
    said = (str(exc).strip().splitlines() or [""])[0][:300]
    return ArtifactError(
        f"trial {cand.number} (run {cand.run_id}): its artifact {layout.ART_ONNX_DIR}/model.onnx (or "
        f"onnx_parity.json beside it) is not a model onnxruntime can load and run on the trial's inputs "
        f"({type(exc).__name__}: {said}); it is corrupt, truncated or not the file the trial exported. Nothing "
        f"was promoted. Log the trial's own files again where its folder still holds them "
        f"(MlflowClient({uri!r}).log_artifact({cand.run_id!r}, 'runs/<study>/trial-{cand.number:04d}/model.onnx', "
        f"'onnx'), the same for onnx_parity.json), or have promote skip this trial: "
        f"MlflowClient({uri!r}).set_tag({cand.run_id!r}, {layout.TAG_ONNX_PASSED!r}, 'false')")


def signature_of(example, predictions):
    """The signature of ``example`` -> ``predictions``: the outputs only. An MLflow tensor schema
    holds one dtype and pyfunc refuses any other (float32 or uint8 images against a float64
    example), printing the whole array; the task's input contract (``Task.natural_input``: dtype
    kinds, shape, range, finite) is what the model checks instead (``sweeps.serving.predict``),
    and the input example still shows a caller what to pass."""
    from mlflow.models import ModelSignature, infer_signature

    return ModelSignature(inputs=None, outputs=infer_signature(example, predictions).outputs)


def save_pytorch(model, path: Path, inputs, console) -> str:
    """Save the module as an MLflow PyTorch model at ``path``: a ``torch.export`` program ("pt2":
    loads without pickle, and without this project's model classes) when it can be captured, else
    pickled; returns the format used."""
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    example = inputs[:EXAMPLE_ROWS]
    with torch.inference_mode():
        signature = infer_signature(example, model(torch.from_numpy(example)).numpy())
    try:
        mlflow.pytorch.save_model(model, str(path), signature=signature, input_example=example,
                                  serialization_format="pt2", pip_requirements=_pip_requirements())
        return "pt2"
    except Exception as exc:  # noqa: BLE001 - torch.export fails in many ways: fall back to pickle, saying why
        shutil.rmtree(path, ignore_errors=True)
        console.print(f"torch.export could not capture the model ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                      "its PyTorch module is saved with pickle", markup=False, highlight=False)
    mlflow.pytorch.save_model(model, str(path), signature=signature, serialization_format="pickle",
                              pip_requirements=_pip_requirements())
    return "pickle"


def log_model(reader: TrackingReader, uri: str, spec, cand: Candidate, console) -> tuple[str, str, dict]:
    """Log the candidate's model into its run as the pyfunc model of ``sweeps.serving``; returns
    (model uri, model id, tags: the ONNX ones and the input contract)."""
    import mlflow
    import mlflow.pyfunc
    from mlflow.models import Model

    from core.onnx_export import set_metadata  # lazy: ONNX, only to promote
    from sweeps import serving  # lazy: mlflow.pyfunc, only to promote

    with tempfile.TemporaryDirectory(prefix="sweeps-promote-") as tmp:
        model, task, resolved = build_model(reader, spec, cand, tmp)
        section = task_section(resolved, spec, cand)
        inputs = example_inputs(task)
        example = natural_examples(task, console)
        natural = example is not None
        if not natural:
            example = inputs[:EXAMPLE_ROWS]
            console.print(f"the registered model takes model inputs: task {task.name!r} gives no natural examples",
                          markup=False, highlight=False)
        signature = signature_of(example, serving.predict(task, model, example, natural))
        contract = serving.contract(task, natural)
        tags = {"sweeps.onnx": "absent", "sweeps.input": "natural" if natural else "model input",
                "sweeps.input_contract": contract}
        if cand.run.data.tags.get(TAG_MODEL_ID):  # the trial's checkpoint model, which this one serves
            tags[TAG_CHECKPOINT_MODEL] = cand.run.data.tags[TAG_MODEL_ID]
        artifacts = {serving.ART_TASK: str(Path(tmp) / serving.TASK_FILE)}
        Path(artifacts[serving.ART_TASK]).write_text(json.dumps({"task": section, "natural_input": natural},
                                                                indent=2, sort_keys=True))
        onnx = _download(reader, cand.run_id, f"{layout.ART_ONNX_DIR}/model.onnx", tmp)
        if onnx is not None:
            report_path = _download(reader, cand.run_id, f"{layout.ART_ONNX_DIR}/onnx_parity.json", tmp)
            try:  # a file that onnx or onnxruntime cannot take is a damaged artifact, not a crash
                original = json.loads(report_path.read_text()) if report_path is not None else None
                tolerance = float((resolved.get("train") or {}).get("onnx_tolerance")
                                  or (original or {}).get("tolerance") or 1e-4)
                set_metadata(onnx, serving.onnx_metadata(task, section))  # says what the file does not do
                report = verify_onnx(onnx, model, inputs, tolerance, original)
            except Exception as exc:  # noqa: BLE001 - DecodeError, onnxruntime's Fail/InvalidGraph, JSON, ...
                raise unusable_onnx(uri, cand, exc) from None
            if not report["passed"]:
                raise PromoteError(f"the ONNX model of trial {cand.number} (run {cand.run_id}) fails re-verification: "
                                   f"max |onnxruntime - torch| = {report['max_abs_diff']:.3g} > tolerance "
                                   f"{tolerance:.3g} over {report['n_inputs_checked']} inputs; not promoted")
            verified = Path(tmp) / serving.ONNX_REPORT_FILE
            verified.write_text(json.dumps(report, indent=2))
            artifacts.update({serving.ART_ONNX: str(onnx), serving.ART_ONNX_REPORT: str(verified)})
            tags.update({"sweeps.onnx": f"artifacts/{serving.ONNX_FILE}", "sweeps.onnx_preprocessing": "not included",
                         "sweeps.onnx_tolerance": repr(tolerance),
                         "sweeps.onnx_max_abs_diff": repr(report["max_abs_diff"]),
                         "sweeps.onnx_sha256": report["onnx_sha256"]})
            console.print(f"ONNX re-verified: max |onnxruntime - torch| = {report['max_abs_diff']:.3g} <= "
                          f"{tolerance:.3g} over {report['n_inputs_checked']} inputs", markup=False, highlight=False)
        _add_torchscript(reader, cand, tmp, model, inputs, resolved, artifacts, tags, console)
        artifacts[serving.ART_TORCH] = str(Path(tmp) / serving.ART_TORCH)
        tags["sweeps.pytorch_format"] = save_pytorch(model, Path(artifacts[serving.ART_TORCH]), inputs, console)
        with fluent_uri(uri), _no_pickle_notice():  # Model.log reads the fluent URI; the run is addressed by id
            logged = reader.registry.create_logged_model(cand.run.info.experiment_id, name=promoted_name(cand.number),
                                                         source_run_id=cand.run_id,
                                                         tags={TAG_PROMOTED: "true", TAG_FORMAT: serving.MODEL_FORMAT,
                                                               **tags})
            # Model.log is what mlflow.pyfunc.log_model calls, plus the run id it does not pass on.
            info = Model.log(artifact_path=None, name=promoted_name(cand.number), flavor=mlflow.pyfunc,
                             run_id=cand.run_id, model_id=logged.model_id, python_model=serving.TaskModel(),
                             artifacts=artifacts, signature=signature, input_example=example,
                             pip_requirements=_pip_requirements())
    if tags.get(TAG_CHECKPOINT_MODEL):
        _share_metrics(reader.registry, tags[TAG_CHECKPOINT_MODEL], info.model_id, cand.run_id)
    return info.model_uri, info.model_id, tags


def _share_metrics(registry, checkpoint_model_id: str, model_id: str, run_id: str) -> None:
    """Give the promoted model the best epoch's metrics of the trial's checkpoint model (``val_acc``
    in the Models tab). The same points (step, timestamp, value) logged again with the new model's
    id attach to it only: the run's curves keep one row per point."""
    from mlflow.entities import Metric  # lazy: mlflow, only when a model is promoted

    points = registry.get_logged_model(checkpoint_model_id).metrics or []
    if points:
        registry.log_batch(run_id, metrics=[
            Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, dataset_name=m.dataset_name,
                   dataset_digest=m.dataset_digest) for m in points], synchronous=True)
