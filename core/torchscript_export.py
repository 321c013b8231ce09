"""Export a trained model to TorchScript (``model.ts``) and prove it computes what eager PyTorch does.

``train.export_torchscript: script`` compiles the module's code with ``torch.jit.script`` (control
flow kept); ``trace`` records the ops one batch runs through with ``torch.jit.trace`` (control flow
frozen to that batch's path). Either way the saved file is loaded back and compared with the eager
model on validation inputs at two batch sizes, with the ONNX check's tolerance: a traced model
whose graph froze a batch size or a branch fails here, not in production.

As for ONNX, the file at ``path`` only ever holds a verified model (written beside it, then moved).
A model TorchScript cannot compile raises :class:`TorchScriptError` naming the innermost module
that fails, so the fix is one class to annotate, not a traceback to read.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from core.onnx_export import _cpu_eval_copy  # the same CPU, fp32, eval-mode copy ONNX exports

Mode = Literal["trace", "script"]
MAX_CHECK_SAMPLES = 256
CHECK_BATCH = 64


class TorchScriptError(RuntimeError):
    """The model cannot be turned into TorchScript; the message names the module and the fix."""


@dataclass
class TorchScriptReport:
    """What ``export_torchscript`` measured; ``passed`` False means ``path`` was not written."""

    path: str
    mode: str
    max_abs_diff: float
    tolerance: float
    passed: bool
    n_inputs_checked: int
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def export_torchscript(model: nn.Module, sample_inputs: torch.Tensor, path: str | os.PathLike, mode: Mode,
                       tolerance: float = 1e-4) -> TorchScriptReport:
    """Script or trace a CPU fp32 eval copy of ``model``, save it to ``path`` and compare the loaded
    file with the eager copy on up to 256 of ``sample_inputs``. Raises TorchScriptError when the
    model cannot be compiled; returns a report with ``passed`` False (``path`` untouched) when the
    outputs differ by more than ``tolerance``."""
    path = Path(path)
    eager = _cpu_eval_copy(model)
    inputs = sample_inputs[:MAX_CHECK_SAMPLES].detach().to("cpu")
    if inputs.is_floating_point():
        inputs = inputs.float()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with warnings.catch_warnings():
            # torch >= 2.9 marks torch.jit deprecated (FutureWarning) on every call; the format still loads
            # in libtorch (C++) without Python, which is why this export exists beside ONNX.
            warnings.simplefilter("ignore", FutureWarning)
            compiled = _script(eager) if mode == "script" else _trace(eager, inputs[:CHECK_BATCH])
            torch.jit.save(compiled, str(tmp))
            loaded = torch.jit.load(str(tmp), map_location="cpu")
        max_diff = _max_diff(eager, loaded, inputs)
        report = TorchScriptReport(str(path), mode, max_diff, float(tolerance), max_diff <= tolerance, len(inputs))
        if report.passed:
            os.replace(tmp, path)
        else:
            report.error = (f"TorchScript ({mode}) parity check failed: max |torchscript - eager| = {max_diff:.3g} > "
                            f"tolerance {tolerance:.3g} over {len(inputs)} inputs; {path.name} was not written"
                            + ("; a traced model freezes control flow and shapes: try export_torchscript: script"
                               if mode == "trace" else ""))
    finally:
        tmp.unlink(missing_ok=True)
    return report


def _script(model: nn.Module) -> torch.jit.ScriptModule:
    try:
        return torch.jit.script(model)
    except Exception as exc:  # noqa: BLE001 - the compiler raises many kinds; the culprit module is the message
        culprit = _innermost_unscriptable(model) or ("<model>", model)
        name, module = culprit
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise TorchScriptError(
            f"train.export_torchscript: script: module {name} ({type(module).__name__}) cannot be scripted: "
            f"{first}; make its forward TorchScript-compatible (type annotations, no unsupported Python), "
            f"or use export_torchscript: trace") from None


def _innermost_unscriptable(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The deepest submodule that fails to script on its own (children are tried before parents)."""
    modules = list(model.named_modules())
    for name, module in reversed(modules):  # named_modules lists parents first
        try:
            torch.jit.script(module)
        except Exception:  # noqa: BLE001 - any failure marks it
            return (name or "<model>"), module
    return None


def _trace(model: nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    try:
        with warnings.catch_warnings():  # TracerWarnings are what the parity check then tests
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return torch.jit.trace(model, example, check_trace=False)
    except Exception as exc:  # noqa: BLE001 - e.g. an output that is not a tensor or a tuple of them
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise TorchScriptError(f"train.export_torchscript: trace: module <model> ({type(model).__name__}) cannot "
                               f"be traced: {first}; return tensors from forward, or use export_torchscript: "
                               f"script") from None


def _max_diff(eager: nn.Module, compiled: torch.jit.ScriptModule, inputs: torch.Tensor) -> float:
    """Max |compiled - eager| over ``inputs``, both run in the same batches, at two batch sizes (a
    trace that froze the batch size or a shape-dependent branch fails); a NaN, an error or a shape
    mismatch counts as infinitely far."""
    n = len(inputs)
    big = min(CHECK_BATCH, n)
    worst = 0.0
    with torch.inference_mode():
        for batch in dict.fromkeys((big, big // 2 + 1 if big > 1 else 1)):
            for i in range(0, n, batch):
                chunk = inputs[i:i + batch]
                try:
                    got = compiled(chunk)
                except RuntimeError:  # a traced graph that froze the batch size
                    return float("inf")
                want = eager(chunk)
                if got.shape != want.shape:
                    return float("inf")
                diff = (got.double() - want.double()).abs()
                worst = max(worst, float(diff.max()) if bool(torch.isfinite(diff).all()) else float("inf"))
    return worst
