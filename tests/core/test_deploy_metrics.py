"""Deployment figures of an exported model: latency that is stable between measurements, a bigger
batch measured slower, and parameter count and file size that match the model."""
from __future__ import annotations

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


def test_two_measurements_of_one_model_agree_within_the_reported_spread(tmp_path):
    _, sample, path = _exported(tmp_path, 16)
    first, second = (onnx_latency(path, sample, 1, runs=60) for _ in range(2))
    assert first.threads == 1 and first.batch == 1 and first.p95_ms >= first.p50_ms > 0
    assert abs(first.p50_ms - second.p50_ms) <= max(first.spread_ms, second.spread_ms), (first, second)


def test_figures_of_a_model(tmp_path):
    model, sample, path = _exported(tmp_path, 16)
    got = deployment_metrics(path, sample, model, batches=(1, 16), runs=20)
    assert got["params"] == sum(p.numel() for p in model.parameters()) == count_params(model)
    assert abs(got["onnx_size_mb"] - path.stat().st_size / 1e6) < 1e-9
    assert got["onnx_size_bytes"] == path.stat().st_size
    assert got["onnx_size_mb"] * 1e6 > 4 * got["params"] * 0.9  # fp32 weights are most of the file
    assert {"onnx_latency_ms", "onnx_latency_p95_ms", "onnx_latency_spread_ms", "onnx_latency_b16_ms"} <= set(got)
    assert got["onnx_latency_b16_ms"] > got["onnx_latency_ms"]  # 16 inputs cost more than one
