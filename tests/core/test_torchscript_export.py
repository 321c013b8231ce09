"""TorchScript export beside ONNX: model.ts computes what eager PyTorch does (1e-4), a traced model
that froze a branch fails the check, and a model that cannot be scripted is named, not a traceback."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from core.finalize import best_model
from core.reporting import RecordingReporter
from core.tasks.digits import DigitsTask
from core.torchscript_export import TorchScriptError, export_torchscript
from core.train import train
from tests.core.helpers import fast_config


class _Unscriptable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, *inputs):  # TorchScript takes no variable argument lists
        return self.fc(inputs[0])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU())
        self.head = _Unscriptable()

    def forward(self, x):
        return self.head(self.body(x))


class _BatchBranch(nn.Module):
    """Doubles its output unless the batch has 64 rows: a trace at 64 freezes the first branch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        out = self.fc(x.flatten(1))
        if x.shape[0] == 64:
            return out
        return out * 2


@pytest.mark.parametrize("mode", ["trace", "script"])
def test_model_ts_matches_the_eager_model_on_validation_inputs(tmp_path, mode):
    rec = RecordingReporter()
    task = DigitsTask("mlp")
    cfg = fast_config(epochs=1, save_checkpoints=True, export_torchscript=mode, max_steps_per_epoch=10)
    result = train(task, cfg, reporter=rec, out_dir=tmp_path)
    assert result.status == "completed" and result.reason == ""
    report = json.loads((tmp_path / "torchscript_parity.json").read_text())
    assert report["passed"] and report["mode"] == mode and report["n_inputs_checked"] == 256
    assert 0 <= report["max_abs_diff"] <= 1e-4 and report == result.torchscript
    assert (tmp_path / "model.ts", "torchscript") in rec.artifacts
    assert (tmp_path / "torchscript_parity.json", "torchscript_report") in rec.artifacts
    # Independently: the file, loaded, gives the best checkpoint's outputs on validation inputs.
    loaded = torch.jit.load(str(tmp_path / "model.ts"))
    eager = best_model(DigitsTask("mlp").build_model(), tmp_path).eval()
    x = torch.stack([task.datasets()[1][i][0] for i in range(40)])
    with torch.inference_mode():
        assert torch.allclose(loaded(x), eager(x), atol=1e-4)


def test_a_model_that_cannot_be_scripted_is_named_and_the_trial_keeps_its_metrics(tmp_path):
    with pytest.raises(TorchScriptError, match=r"module head \(_Unscriptable\) cannot be scripted"):
        export_torchscript(_Net(), torch.randn(8, 1, 8, 8), tmp_path / "model.ts", "script")

    class Task(DigitsTask):
        def build_model(self):
            return _Net()

    result = train(Task("mlp"), fast_config(epochs=1, export_torchscript="script"), out_dir=tmp_path)
    assert result.status == "completed" and result.best_metric is not None
    assert "module head (_Unscriptable) cannot be scripted" in result.reason and "Traceback" not in result.reason
    assert result.torchscript is not None and result.torchscript["passed"] is False
    assert not (tmp_path / "model.ts").exists()


def test_a_trace_that_froze_a_branch_fails_the_check_and_script_keeps_it():
    model, x = _BatchBranch(), torch.randn(100, 64)
    traced = export_torchscript(model, x, "/tmp/never-written-trace.ts", "trace")
    assert not traced.passed and traced.max_abs_diff > 1e-4 and "try export_torchscript: script" in traced.error
    scripted = export_torchscript(model, x, _tmp_ts(), "script")
    assert scripted.passed and scripted.max_abs_diff == 0.0


def _tmp_ts():
    import tempfile

    return tempfile.mkdtemp() + "/model.ts"
