"""Deployment figures of an exported model: latency as the percentiles of timed calls after a
warm-up (read from a clock whose readings the test knows: no two wall-clock measurements are
compared), and parameter count and file size that match the model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from core.deploy_metrics import count_params, deployment_metrics, onnx_latency
from core.onnx_export import export_and_verify
from core.tasks.digits import DigitsTask
from core.tasks.digits_models import DigitsCNN


def _exported(tmp_path, width: int):
    torch.manual_seed(0)
    model = DigitsCNN(width=width)
    _, val = DigitsTask("cnn").datasets()
    sample = val.x[:64]
    path = tmp_path / f"cnn{width}.onnx"
    export_and_verify(model, sample, path)
    return model, sample.numpy(), path


class _Clock:
    """A clock whose readings are known: the n-th timed call takes ``n`` ms (1, 2, ... runs), and
    it counts how often it was read (twice per timed call; never during the warm-up)."""

    def __init__(self) -> None:
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        call, end = divmod(self.readings - 1, 2)
        return (call + 1) * 1.0 + end * (call + 1) / 1000.0  # start at call+1 s, end call+1 ms later


def test_latency_is_the_percentiles_of_the_timed_calls_after_the_warm_up(tmp_path):
    _, sample, path = _exported(tmp_path, 16)
    clock = _Clock()
    got = onnx_latency(path, sample, 4, runs=21, warmup=5, clock=clock)
    assert clock.readings == 2 * 21  # the 5 warm-up calls are not timed
    times = np.arange(1, 22, dtype=float)  # ms: the n-th timed call took n ms
    p5, p50, p95 = np.percentile(times, [5, 50, 95])
    assert got.p50_ms == pytest.approx(p50) == pytest.approx(11.0)
    assert got.p95_ms == pytest.approx(p95) and got.spread_ms == pytest.approx(p95 - p5) == pytest.approx(18.0)
    assert (got.batch, got.runs, got.threads, got.provider) == (4, 21, 1, "CPUExecutionProvider")


def test_a_measurement_needs_a_batch_and_two_runs(tmp_path):
    _, sample, path = _exported(tmp_path, 16)
    with pytest.raises(ValueError, match="batch >= 1 and runs >= 2"):
        onnx_latency(path, sample, 1, runs=1)


def test_figures_of_a_model(tmp_path):
    model, sample, path = _exported(tmp_path, 16)
    got = deployment_metrics(path, sample, model, batches=(1, 16), runs=20)
    assert got["params"] == sum(p.numel() for p in model.parameters()) == count_params(model)
    assert abs(got["onnx_size_mb"] - path.stat().st_size / 1e6) < 1e-9
    assert got["onnx_size_bytes"] == path.stat().st_size
    assert got["onnx_size_mb"] * 1e6 > 4 * got["params"] * 0.9  # fp32 weights are most of the file
    assert {"onnx_latency_ms", "onnx_latency_p95_ms", "onnx_latency_spread_ms", "onnx_latency_b16_ms"} <= set(got)
    assert all(got[k] > 0 for k in ("onnx_latency_ms", "onnx_latency_b16_ms"))
    assert got["onnx_latency_p95_ms"] >= got["onnx_latency_ms"]  # two percentiles of the same timed calls
