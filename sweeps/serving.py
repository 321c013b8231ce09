"""The registered model users call: ``mlflow.pyfunc.load_model(uri).predict(x)`` takes the task's
natural input (for digits, the raw 8x8 pixels scikit-learn gives) and returns predictions in the
target's terms (class indices for classification): ``task.postprocess(model(task.preprocess(x)))``.
Each batch is first checked against the task's input contract (``Task.natural_input``: dtype
kinds, sample shape, declared range, finite) and refused whole, in one line, when a row is outside it.

What ``sweeps promote`` logs (``sweeps.model_logging``) and :class:`TaskModel` loads, under the
logged model's ``artifacts/``:

- ``pytorch_model/``: the trained module with the trial's best weights, as an MLflow PyTorch model
  (``mlflow.pytorch.load_model`` loads it alone, for users who want the raw module): a
  ``torch.export`` program (no pickle) when the module can be captured, else pickled;
- ``task.json``: the trial's task section (name or target, model, args), from which the task is
  rebuilt for its ``preprocess`` and ``postprocess``, and whether the input is natural;
- ``model.onnx`` and ``onnx_parity.json``: the trial's ONNX model (model input in, raw output
  out; no pre- or postprocessing) and its re-verification.

Loading needs this project installed (its tasks and this module) and nothing else: no training
data, no pretrained-weight file, no environment variable. A task is rebuilt, never trained, and a
task's constructor touches no files (spec validation relies on the same).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.pyfunc.model import PythonModel

from core.tasks.inputs import InputRefused, InputSpec
from sweeps.resolved_config import task_from_resolved

ART_TORCH, ART_TASK, ART_ONNX, ART_ONNX_REPORT = "pytorch_model", "task", "onnx_model", "onnx_parity"
ONNX_FILE, ONNX_REPORT_FILE, TASK_FILE = "model.onnx", "onnx_parity.json", "task.json"
MODEL_FORMAT = "pyfunc-task/1"  # tag value of logged models in this layout (older ones are not reused)
PREDICT_CHUNK = 256  # rows per forward pass, so a large batch does not hold every activation at once


def as_array(model_input: Any) -> np.ndarray:
    """``model_input`` as a numpy array: a pandas DataFrame by its values; a list of images of
    different sizes as a one-dimensional object array (one natural input per row)."""
    if hasattr(model_input, "to_numpy"):
        return np.asarray(model_input.to_numpy())
    if isinstance(model_input, dict):
        raise TypeError("the model takes one array (a batch), not a dict of named inputs")
    if hasattr(model_input, "numpy") and not isinstance(model_input, np.ndarray):
        return np.asarray(model_input.numpy())  # a torch tensor
    try:
        return np.asarray(model_input)
    except ValueError:  # ragged: rows of different shapes
        rows = np.empty(len(model_input), dtype=object)
        rows[:] = [np.asarray(row) for row in model_input]
        return rows


def model_inputs(task, rows: np.ndarray, natural: bool):
    """The model-input batch of ``rows``: ``task.preprocess`` of natural input, row by row when the
    rows are of different shapes; model inputs as given (floats as float32) otherwise."""
    import torch

    if not natural:
        x = torch.from_numpy(np.ascontiguousarray(rows))
        return x.float() if x.is_floating_point() else x
    if rows.dtype == object:
        return torch.cat([task.preprocess(torch.from_numpy(np.ascontiguousarray(row))[None]) for row in rows])
    return task.preprocess(torch.from_numpy(np.ascontiguousarray(rows)))


def input_spec(task, natural: bool) -> InputSpec:
    """What the model answers: the task's natural input, or (a task without natural examples)
    finite model inputs of its ``input_shape``."""
    if natural:
        return task.natural_input
    return InputSpec(shapes=(tuple(task.input_shape),) if task.input_shape else ())


def predict(task, model, model_input: Any, natural: bool = True) -> np.ndarray:
    """``task.postprocess(model(task.preprocess(x)))`` over ``model_input``, in chunks, on the CPU.
    A batch with any row outside the task's input contract is refused whole (``InputRefused``)."""
    import torch

    rows = as_array(model_input)
    if rows.ndim == 0 or len(rows) == 0:
        raise InputRefused(f"the model takes a batch of at least one input; got an array shaped {rows.shape}")
    input_spec(task, natural).check(rows)
    outs = []
    with torch.inference_mode():
        for start in range(0, len(rows), PREDICT_CHUNK):
            outs.append(task.postprocess(model(model_inputs(task, rows[start:start + PREDICT_CHUNK], natural))))
    return torch.cat(outs).numpy()


class TaskModel(PythonModel):
    """The pyfunc model: the trial's task and trained module, rebuilt from the artifacts above."""

    def load_context(self, context) -> None:
        import mlflow.pytorch

        spec = json.loads(Path(context.artifacts[ART_TASK]).read_text())
        self.natural = bool(spec["natural_input"])
        self.task = task_from_resolved({"task": spec["task"]})  # the same path as `sweeps rerun`
        # A torch.export program (pt2) or a pickled module in eval mode, on the CPU, as promote saved it.
        self.model = mlflow.pytorch.load_model(context.artifacts[ART_TORCH])

    # Annotated np.ndarray: MLflow then neither warns nor validates by the hint. The signature has
    # no input schema (sweeps.model_logging.signature_of): the task's input contract is checked here.
    def predict(self, context, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        return predict(self.task, self.model, model_input, self.natural)


def contract(task, natural: bool) -> str:
    """What a caller passes and gets back, in one sentence that follows "The model " (the model
    version's description opens with it)."""
    if natural and task.input_contract:
        return f"takes {task.input_contract.rstrip('.')}."
    cls = f"{type(task).__module__}.{type(task).__qualname__}"
    if natural:
        return (f"takes the natural input of task {task.name!r} (what {cls}.preprocess takes, shaped like the "
                "input example) and returns its postprocess of the model output.")
    shape = ", ".join(str(s) for s in task.input_shape) or "..."
    return (f"takes model inputs of task {task.name!r} shaped (N, {shape}), as its datasets() yield them, not "
            f"natural input (the task gives no natural examples), and returns {cls}.postprocess of the model output.")


def onnx_metadata(task, section: dict[str, Any]) -> dict[str, str]:
    """ONNX ``metadata_props`` saying what the ONNX file does not do: preprocessing, postprocessing."""
    from core.onnx_export import INPUT_NAME, OUTPUT_NAME  # lazy: serving runs onnxruntime, not torch

    cls = f"{type(task).__module__}.{type(task).__qualname__}"
    shape = ", ".join(str(s) for s in task.input_shape) or "..."
    return {
        "sweeps.preprocessing": (f"not included: input {INPUT_NAME!r} is the model input of task {task.name!r} "
                                 f"(shaped (N, {shape}), what its datasets() yield); apply {cls}.preprocess to "
                                 "natural input first, or use the registered pyfunc model, which does"),
        "sweeps.postprocessing": (f"not included: output {OUTPUT_NAME!r} is the raw model output; {cls}.postprocess "
                                  "turns it into predictions (the argmax class index for classification)"),
        "sweeps.task": json.dumps(section, sort_keys=True),
    }


def description(tags: dict[str, str], trial: int, study: str) -> str:
    """The model version's description: the input contract, then where it comes from and the ONNX file."""
    onnx = tags.get("sweeps.onnx", "absent")
    onnx_text = ("No ONNX model." if onnx == "absent" else
                 f"The ONNX file {onnx} takes model inputs: preprocessing and postprocessing are not included "
                 "(its metadata_props sweeps.preprocessing says what to apply).")
    contract_text = tags.get("sweeps.input_contract")
    opening = f"The model {contract_text} " if contract_text else ""
    return f"{opening}Trial {trial} of study {study}. {onnx_text}"
