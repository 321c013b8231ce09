"""NaN forensics: a diverged run writes diverged.json with the step, batch, gradients, lr, AMP scale,
and (train.detect_anomaly) the operator that first made the NaN."""
from __future__ import annotations

import json

import torch
from torch import nn

from core.reporting import RecordingReporter
from core.tasks.digits import DigitsTask
from core.train import train
from tests.core.helpers import fast_config


class _NanForward(DigitsTask):
    """A digits MLP whose second Linear starts returning NaN after a number of calls."""

    def __init__(self, after_calls: int) -> None:
        super().__init__("mlp")
        self.after_calls = after_calls

    def build_model(self):
        model = super().build_model()
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        calls = {"n": 0}

        def hook(_module, _inputs, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] > self.after_calls else output

        linears[1].register_forward_hook(hook)
        return model


class _LogOfZero(nn.Module):
    """Finite forward, NaN backward: log(0) is computed but never selected, and its gradient is 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        out = self.fc(x.flatten(1))
        return torch.where(out > 1e9, torch.log(out * 0), out)


class _NanBackward(DigitsTask):
    def __init__(self) -> None:
        super().__init__("mlp")

    def build_model(self):
        return _LogOfZero()


def test_diverged_json_names_step_batch_gradients_lr_and_the_module(tmp_path):
    rec = RecordingReporter()
    cfg = fast_config(epochs=1, grad_accum_steps=2, lr=0.03, detect_anomaly=True)
    result = train(_NanForward(after_calls=5), cfg, reporter=rec, out_dir=tmp_path)
    assert result.status == "diverged"
    path = tmp_path / "diverged.json"
    assert (path, "diverged") in rec.artifacts
    record = json.loads(path.read_text())
    # Call 6 is the 6th micro-batch: step 3 (two micro-batches a step), index 5 of the epoch.
    assert record["global_step"] == 3 and record["epoch"] == 1 and record["micro_batch_index"] == 5
    first, second = record["step_losses"]  # the step's two micro-batches; NaN is written as null
    assert 0 < first < 5 and second is None
    assert record["lr"] == 0.03 and record["amp_scale"] is None and record["observed_one_step_late"] is False
    stats = record["input_stats"]
    assert stats["shape"] == [32, 1, 8, 8] and stats["nonfinite"] == 0 and stats["min"] <= stats["mean"] <= stats["max"]
    assert record["target_stats"]["min"] >= 0 and record["target_stats"]["max"] <= 9
    grads = record["largest_grad_norms"]
    assert len(grads) == 5 and grads[0]["grad_norm"] is None  # a NaN gradient is listed first
    anomaly = record["anomaly"]
    assert anomaly["first_nonfinite_module"].endswith("(Linear)") and anomaly["backward_op"]
    assert "first non-finite output:" in result.reason and "largest grad norm" in result.reason


def test_detect_anomaly_names_the_backward_op_that_made_the_nan(tmp_path):
    result = train(_NanBackward(), fast_config(epochs=1, detect_anomaly=True), out_dir=tmp_path)
    assert result.status == "diverged" and "non-finite gradient norm" in result.reason
    anomaly = json.loads((tmp_path / "diverged.json").read_text())["anomaly"]
    assert anomaly["first_nonfinite_module"] is None  # the forward pass stayed finite
    assert anomaly["backward_op"] == "LogBackward0"
    assert "first NaN in backward: LogBackward0" in result.reason
    assert result.diverged is not None and result.diverged["global_step"] == 1


def test_without_detect_anomaly_nothing_is_replayed(tmp_path):
    result = train(_NanBackward(), fast_config(epochs=1), out_dir=tmp_path)
    record = json.loads((tmp_path / "diverged.json").read_text())
    assert record["anomaly"] is None and record["largest_grad_norms"][0]["param"] in ("fc.weight", "fc.bias")
    assert result.status == "diverged"
