"""The model ``sweeps promote`` logs into a trial's run: the trial's best weights as an MLflow
PyTorch model, with a signature and an input example, and the trial's ONNX model re-verified
against it (onnxruntime vs torch on validation inputs) as extra files with the parity report.
A logged model left by a crashed promote is found and reused (``find_logged_model``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeps.errors import PromoteError, SweepsError
from sweeps.tracking import layout
from sweeps.tracking.reader import TrackingReader

if TYPE_CHECKING:
    from sweeps.registry import Candidate

MODEL_ARTIFACT = "model"  # the logged model's name in the trial's run
TAG_PROMOTED = "sweeps.promoted"  # "true" on logged models written by promote
EXAMPLE_ROWS = 8  # rows of the input example stored with the model
CHECK_ROWS = 256  # validation inputs the ONNX re-verification runs on


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
def fluent_uri(uri: str):
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
        with fluent_uri(uri):  # log_model reads the fluent URI; the run is addressed by id
            logged = reader.registry.create_logged_model(cand.run.info.experiment_id, name=MODEL_ARTIFACT,
                                                         source_run_id=cand.run_id,
                                                         tags={TAG_PROMOTED: "true", **onnx_tags})
            info = mlflow.pytorch.log_model(model, name=MODEL_ARTIFACT, model_id=logged.model_id, run_id=cand.run_id,
                                            signature=signature, input_example=example, extra_files=extra or None,
                                            pip_requirements=_pip_requirements())
    return info.model_uri, info.model_id, onnx_tags
