"""What a model costs where it is deployed, measured the same way for every trial: onnxruntime
latency on CPU (p50 and p95 at batch 1 and at a given batch, warm, on pinned threads, with the
spread of the runs), the trainable parameter count and the ONNX file's size; on a machine whose
onnxruntime has CUDA, the same latency on the GPU.

Latency is read from the ONNX file, not the PyTorch model: it is what a deployment runs. Warm:
``warmup`` calls first (allocation, kernel choice), then ``runs`` timed calls of one batch each.
Pinned: one intra-op thread and one inter-op thread unless told otherwise, so two trials measured
on a shared machine do not fight over a thread pool, and the figure does not depend on how many
cores the trial's worker happened to get. ``spread_ms`` is p95 - p5 of the timed calls: two
measurements of the same model are expected to agree within it.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from torch import nn

WARMUP = 10
RUNS = 50


@dataclass(frozen=True)
class Latency:
    """One latency measurement of an ONNX model at one batch size, in milliseconds."""

    batch: int
    p50_ms: float
    p95_ms: float
    spread_ms: float  # p95 - p5 of the timed calls
    runs: int
    threads: int
    provider: str

    def to_dict(self) -> dict:
        return asdict(self)


def count_params(model: nn.Module) -> int:
    """Trainable parameters (buffers such as BatchNorm statistics are not parameters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def onnx_latency(model_path: str | os.PathLike, sample: np.ndarray, batch: int, *, threads: int = 1,
                 warmup: int = WARMUP, runs: int = RUNS, provider: str = "CPUExecutionProvider",
                 clock: Callable[[], float] = time.perf_counter) -> Latency:
    """Latency of ``model_path`` on ``batch`` inputs shaped like ``sample``'s rows (repeated
    when it has fewer). ``sample`` is one real input batch (N, ...), so the figure is the model's
    on its own kind of data (sizes, dtype). ``clock`` (seconds) times each call: tests give one
    whose readings they know."""
    import onnxruntime as ort

    if batch < 1 or runs < 2:
        raise ValueError(f"onnx_latency needs batch >= 1 and runs >= 2, got batch={batch}, runs={runs}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(model_path), sess_options=opts, providers=[provider])
    name = session.get_inputs()[0].name
    rows = np.resize(sample, (batch, *sample.shape[1:])).astype(sample.dtype, copy=False)
    feed = {name: np.ascontiguousarray(rows)}
    for _ in range(warmup):
        session.run(None, feed)
    times = np.empty(runs)
    for i in range(runs):
        start = clock()
        session.run(None, feed)
        times[i] = (clock() - start) * 1000.0
    p5, p50, p95 = np.percentile(times, [5, 50, 95])
    return Latency(batch=batch, p50_ms=float(p50), p95_ms=float(p95), spread_ms=float(p95 - p5), runs=runs,
                   threads=threads, provider=provider)


def deployment_metrics(model_path: str | os.PathLike, sample: np.ndarray, model: nn.Module | None = None, *,
                       batches: Sequence[int] = (1,), threads: int = 1, runs: int = RUNS) -> dict[str, float]:
    """The deployment figures of one exported model, as flat metrics a study can optimise or
    constrain: ``onnx_latency_ms`` / ``onnx_latency_p95_ms`` / ``onnx_latency_spread_ms`` (batch 1),
    the same with ``_b<N>`` for every other batch, ``onnx_size_mb`` and ``onnx_size_bytes``,
    ``params`` (when ``model`` is given) and ``gpu_latency_ms`` where onnxruntime has CUDA."""
    import onnxruntime as ort

    size = _size_bytes(Path(model_path))
    out: dict[str, float] = {"onnx_size_mb": size / 1e6, "onnx_size_bytes": float(size)}
    if model is not None:
        out["params"] = float(count_params(model))
    for batch in dict.fromkeys((1, *batches)):
        lat = onnx_latency(model_path, sample, batch, threads=threads, runs=runs)
        suffix = "" if batch == 1 else f"_b{batch}"
        out[f"onnx_latency{suffix}_ms"] = lat.p50_ms
        out[f"onnx_latency{suffix}_p95_ms"] = lat.p95_ms
        out[f"onnx_latency{suffix}_spread_ms"] = lat.spread_ms
    if "CUDAExecutionProvider" in ort.get_available_providers():
        out["gpu_latency_ms"] = onnx_latency(model_path, sample, 1, runs=runs, provider="CUDAExecutionProvider").p50_ms
    return out


def _size_bytes(path: Path) -> int:
    """The model file plus its external-data file, if the exporter wrote one (models over 2 GB)."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
