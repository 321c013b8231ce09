"""`sweeps promote` registers a trial's model.ts beside its ONNX file, re-verified against the
checkpoint's PyTorch model with the ONNX tolerance; a file that disagrees is refused."""
from __future__ import annotations

import types

import pytest
import torch
from rich.console import Console
from torch import nn

from core.torchscript_export import export_torchscript
from sweeps import model_logging
from sweeps.errors import PromoteError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)).eval()


def _add(tmp_path, monkeypatch, model):
    ts = tmp_path / "model.ts"
    assert export_torchscript(_model(0), torch.randn(32, 1, 8, 8), ts, "script").passed
    asked = []
    monkeypatch.setattr(model_logging, "_download", lambda reader, run_id, path, dest: asked.append(path) or ts)
    artifacts, tags = {}, {}
    cand = types.SimpleNamespace(number=3, run_id="abc")
    inputs = torch.randn(20, 1, 8, 8).numpy()
    model_logging._add_torchscript(None, cand, str(tmp_path), model, inputs, {"train": {"onnx_tolerance": 1e-4}},
                                   artifacts, tags, Console(quiet=True))
    assert asked == ["torchscript/model.ts"]
    return artifacts, tags, ts


def test_the_trials_model_ts_is_registered_beside_onnx(tmp_path, monkeypatch):
    artifacts, tags, ts = _add(tmp_path, monkeypatch, _model(0))
    assert artifacts == {"torchscript_model": str(ts)}
    assert tags["sweeps.torchscript"] == "artifacts/model.ts" and float(tags["sweeps.torchscript_max_abs_diff"]) == 0


def test_a_model_ts_that_disagrees_with_the_checkpoint_is_refused(tmp_path, monkeypatch):
    with pytest.raises(PromoteError, match=r"TorchScript model of trial 3 \(run abc\) fails re-verification"):
        _add(tmp_path, monkeypatch, _model(1))
