"""NaN forensics: what a practitioner needs to find why a run diverged, written as ``diverged.json``.

The loop stops a run at its first non-finite step (core/step_stats.py). Only then is this
module called, once: it costs nothing while the run is healthy. It records the step, the
micro-batch in hand, that batch's input statistics, the step's losses, the largest gradient
norms by parameter name, the learning rate and the AMP scale. With ``train.detect_anomaly``
it also replays the micro-batch under ``torch.autograd.detect_anomaly``, which names the first
backward operator that returned NaN, and with forward hooks names the first module whose
output went non-finite (a NaN made in the forward pass shows up in backward only downstream).

At lag 1 (one CUDA device) the stop is seen one step late: the batch, the gradients and the
weights are then the next step's, and the record says so (``observed_one_step_late``).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.io_utils import save_json_atomic
from core.reporting import Reporter
from core.results import Stop
from core.tasks.base import DataError

DIVERGED_JSON = "diverged.json"
TOP_GRADS = 5  # parameters listed by gradient norm, largest (non-finite first)


def tensor_stats(x: Any) -> Any:
    """min / max / mean / non-finite count of a tensor, or of each tensor in a tuple, list or dict."""
    if isinstance(x, torch.Tensor):
        values = x.detach().float()
        finite = torch.isfinite(values)
        stats: dict[str, Any] = {"shape": list(x.shape), "dtype": str(x.dtype),
                                 "nonfinite": int((~finite).sum())}
        if values.numel():
            stats.update(min=float(values.min()), max=float(values.max()), mean=float(values.mean()))
        return stats
    if isinstance(x, dict):
        return {str(k): tensor_stats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [tensor_stats(v) for v in x]
    return repr(x)[:200]


def largest_grad_norms(model: nn.Module, top: int = TOP_GRADS) -> list[dict[str, Any]]:
    """The ``top`` parameters by gradient norm, non-finite ones first (they are the suspects)."""
    norms = [(name, float(p.grad.detach().float().norm())) for name, p in model.named_parameters()
             if p.grad is not None]
    norms.sort(key=lambda item: math.inf if not math.isfinite(item[1]) else item[1], reverse=True)
    return [{"param": name, "grad_norm": value} for name, value in norms[:top]]


def replay_under_anomaly(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """Run ``loss_fn`` (the micro-batch's forward and loss) and backward under
    ``torch.autograd.detect_anomaly``; report the first module whose output was non-finite and the
    first backward operator that returned NaN. The model's gradients are overwritten: only call
    this once the run is over."""
    first_module: list[str] = []

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        if not first_module and isinstance(output, torch.Tensor) and not bool(torch.isfinite(output).all()):
            first_module.append(f"{names.get(module, '?') or '<model>'} ({type(module).__name__})")

    names = {module: name for name, module in model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    report: dict[str, Any] = {"first_nonfinite_module": None, "backward_op": None, "message": None,
                              "forward_trace": None}
    model.zero_grad(set_to_none=True)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly(check_nan=True):
            warnings.simplefilter("always")
            try:
                loss_fn().backward()
            except RuntimeError as exc:
                report["message"] = str(exc).splitlines()[0]
                # "Function 'LogBackward0' returned nan values in its 0th output."
                text = report["message"]
                if text.startswith("Function '"):
                    report["backward_op"] = text.split("'")[1]
            # Anomaly mode warns with the forward call's stack of the failing backward op.
            traces = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
            if traces:
                report["forward_trace"] = traces[-1][-2000:]
    finally:
        for handle in handles:
            handle.remove()
    report["first_nonfinite_module"] = first_module[0] if first_module else None
    return report


def summary(record: dict[str, Any]) -> str:
    """One line for the run's reason tag: the worst gradient and the anomaly's culprit."""
    parts = []
    if record["largest_grad_norms"]:
        worst = record["largest_grad_norms"][0]
        parts.append(f"largest grad norm {worst['param']}={worst['grad_norm']:.4g}")
    anomaly = record.get("anomaly") or {}
    if anomaly.get("first_nonfinite_module"):
        parts.append(f"first non-finite output: {anomaly['first_nonfinite_module']}")
    if anomaly.get("backward_op"):
        parts.append(f"first NaN in backward: {anomaly['backward_op']}")
    return "; ".join(parts)


def record_divergence(stop: Stop, *, step: int, epoch: int, micro_batch: int, batch: tuple[Any, Any],
                      losses: list[float], model: nn.Module, lr: float, amp_scale: float | None,
                      late: bool, loss_fn: Callable[[], torch.Tensor] | None,
                      out: Path | None, reporter: Reporter) -> tuple[Stop, dict[str, Any]]:
    """Called once, when the loop stops on a non-finite step (rank 0). Writes ``out/diverged.json``
    (logged as artifact kind "diverged") and returns the stop with a summary added to its reason,
    and the record. ``loss_fn`` (``train.detect_anomaly``) replays the micro-batch; None skips it.
    A micro-batch whose inputs or targets hold NaN or infinity is a problem of the data, not
    divergence: DataError, once the record is written (in-memory datasets are refused before any
    step, ``core.data.check_datasets``; this finds it in a stream or a dataset that reads files)."""
    x, y = batch
    record: dict[str, Any] = {
        "reason": stop.reason, "global_step": step, "epoch": epoch, "micro_batch_index": micro_batch,
        "observed_one_step_late": late, "step_losses": losses, "input_stats": tensor_stats(x),
        "target_stats": tensor_stats(y), "largest_grad_norms": largest_grad_norms(model),
        "lr": lr, "amp_scale": amp_scale, "anomaly": None,
    }
    if loss_fn is not None:
        record["anomaly"] = replay_under_anomaly(model, loss_fn)
    if out is not None:
        path = save_json_atomic(record, out / DIVERGED_JSON)
        reporter.log_artifact(path, "diverged")
    bad = {role: nonfinite_count(record[key]) for role, key in (("inputs", "input_stats"), ("targets", "target_stats"))}
    if any(bad.values()):
        where = ", ".join(f"{n} in its {role}" for role, n in bad.items() if n)
        raise DataError(f"the train dataset holds NaN or infinite values: the micro-batch {micro_batch} of epoch "
                        f"{epoch} (step {step}) has {where}, so its loss is {', '.join(map(str, losses))}: a problem "
                        f"of the data, not of the hyperparameters; drop or repair those samples in datasets() "
                        f"({DIVERGED_JSON} has the batch's statistics)")
    extra = summary(record)
    return (Stop(stop.status, f"{stop.reason} ({extra})") if extra else stop), record


def nonfinite_count(stats: Any) -> int:
    """The non-finite values :func:`tensor_stats` counted, over every tensor of a batch."""
    if isinstance(stats, dict):
        return int(stats["nonfinite"]) if "nonfinite" in stats and "shape" in stats else \
            sum(nonfinite_count(v) for v in stats.values())
    if isinstance(stats, list):
        return sum(nonfinite_count(v) for v in stats)
    return 0
