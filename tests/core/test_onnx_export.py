"""ONNX export: parity with PyTorch on the digits CNN and ResNet-18, dynamic batch, atomic files."""
from __future__ import annotations

import errno
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import core.onnx_export as onnx_export
from core.io_utils import atomic_write_bytes
from core.onnx_export import OnnxParityError, export_and_verify, write_report_json
from core.results import OnnxReport
from core.tasks.cifar10 import resnet18_cifar
from core.tasks.digits import DigitsTask
from core.tasks.digits_models import DigitsCNN


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_digits_cnn_parity_on_real_val_inputs(tmp_path):
    torch.manual_seed(0)
    model = DigitsCNN()
    model.train()  # the caller's mode must survive the export
    _, val = DigitsTask().datasets()
    inputs = val.x[:256]
    before = {k: v.clone() for k, v in model.state_dict().items()}

    report = export_and_verify(model, inputs, tmp_path / "digits.onnx", tolerance=1e-4)

    assert isinstance(report, OnnxReport)
    assert report.passed and report.max_abs_diff <= 1e-4
    assert report.n_inputs_checked == len(inputs)
    assert report.opset >= 18
    assert report.exporter == "torchscript"  # the fast exporter, where its trace is faithful
    assert report.torch_latency_ms > 0 and report.ort_latency_ms > 0
    assert model.training, "export must not switch the caller's model to eval mode"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (tmp_path / "digits.onnx").is_file()
    assert _leftovers(tmp_path) == [], "temporary export folder left behind"

    # The named, dynamic batch axis works outside the function too, at sizes never exported.
    session = ort.InferenceSession(str(tmp_path / "digits.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    model.eval()
    for batch in (1, 5, 37):
        x = inputs[:batch]
        (out,) = session.run(["logits"], {"input": x.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(out, model(x).numpy(), atol=1e-4)


@pytest.mark.slow
def test_resnet18_parity_and_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    model = resnet18_cifar()
    inputs = torch.randn(12, 3, 32, 32)
    report = export_and_verify(model, inputs, tmp_path / "sub" / "resnet.onnx", latency_runs=2)
    assert report.passed and report.max_abs_diff <= 1e-4
    assert report.path == tmp_path / "sub" / "resnet.onnx"
    session = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"])
    (out,) = session.run(["logits"], {"input": np.random.randn(3, 3, 32, 32).astype(np.float32)})
    assert out.shape == (3, 10)


def test_single_sample_still_exports_a_dynamic_batch(tmp_path):
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    report = export_and_verify(model, torch.randn(1, 4), tmp_path / "m.onnx", latency_runs=1)
    session = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"])
    (out,) = session.run(["logits"], {"input": np.zeros((6, 4), np.float32)})
    assert out.shape == (6, 3)


def test_parity_failure_raises_and_keeps_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"previous model")
    real_run = onnx_export._run_ort
    # A tiny systematic error in the runtime, as a wrong op translation would produce.
    monkeypatch.setattr(onnx_export, "_run_ort", lambda s, b: real_run(s, b) + np.float32(1e-3))
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(OnnxParityError) as info:
        export_and_verify(model, torch.randn(8, 1, 8, 8), target, tolerance=1e-4, latency_runs=1)
    report = info.value.report
    assert not report.passed
    assert report.max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    assert "tolerance" in str(info.value)
    assert target.read_bytes() == b"previous model"
    assert _leftovers(tmp_path) == []


class _Noisy(nn.Module):
    """Adds ~1e-3 of random noise: exported as an ONNX random op, so the runtimes disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.fc(x)
        return y + 1e-3 * torch.rand_like(y)


def test_nondeterministic_model_fails_the_check(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(OnnxParityError):
        export_and_verify(_Noisy(), torch.randn(16, 4), tmp_path / "noisy.onnx", tolerance=1e-5, latency_runs=1)
    assert not (tmp_path / "noisy.onnx").exists()


def test_nan_output_fails_the_check(tmp_path, monkeypatch):
    real_run = onnx_export._run_ort
    monkeypatch.setattr(onnx_export, "_run_ort", lambda s, b: real_run(s, b) * np.float32("nan"))
    with pytest.raises(OnnxParityError):
        export_and_verify(nn.Linear(4, 2), torch.randn(4, 4), tmp_path / "m.onnx", latency_runs=1)


@pytest.fixture
def registry_builds(monkeypatch):
    """Counts the exporter's registry builds (torch's own builder, wrapped), from an empty cache."""
    from torch.onnx._internal.exporter import _registration

    real = _registration.ONNXRegistry.__dict__["from_torchlib"]
    built = []

    def counting(cls, *args, **kwargs):
        built.append(kwargs.get("opset_version"))
        return real.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(counting))
    monkeypatch.setattr(onnx_export, "_registries", {})
    return built


@pytest.mark.slow
def test_exports_in_one_process_build_the_exporters_registry_once(tmp_path, registry_builds):
    from torch.onnx._internal.exporter import _registration

    wrapped = _registration.ONNXRegistry.__dict__["from_torchlib"]
    torch.manual_seed(0)
    # Different ops in each model: the shared registry must serve them all.
    models = [DigitsCNN(), nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.GELU(), nn.LayerNorm(16),
                                         nn.Linear(16, 10)), DigitsCNN()]
    reports = [export_and_verify(m, torch.randn(8, 1, 8, 8), tmp_path / f"m{i}.onnx", latency_runs=1,
                                 exporter="dynamo") for i, m in enumerate(models)]
    assert [r.passed for r in reports] == [True, True, True]
    assert len(registry_builds) == 1
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is wrapped  # torch's own, back in place
    got = ort.InferenceSession(str(tmp_path / "m1.onnx")).run(None, {"input": np.ones((3, 1, 8, 8), np.float32)})[0]
    with torch.inference_mode():
        want = models[1].eval()(torch.ones(3, 1, 8, 8)).numpy()
    assert np.abs(got - want).max() < 1e-4


def test_write_report_json(tmp_path):
    report = OnnxReport(path=tmp_path / "m.onnx", max_abs_diff=1e-6, tolerance=1e-4, passed=True,
                        n_inputs_checked=8, torch_latency_ms=1.5, ort_latency_ms=0.7, opset=20)
    out = write_report_json(report, tmp_path / "report.json")
    data = json.loads(out.read_text())
    assert data["path"] == str(tmp_path / "m.onnx") and data["passed"] is True and data["opset"] == 20
    assert _leftovers(tmp_path) == []


def test_atomic_write_disk_full_leaves_previous_file_and_no_temp(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")

    def writer(f):
        f.write(b"half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        atomic_write_bytes(target, writer)
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


class _DataDependent(nn.Module):
    """A Python branch on a tensor value: torch.export cannot capture it, TorchScript tracing can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.abs().sum() >= 0:  # always true, so the traced graph is still correct
            return self.fc(x)
        return -self.fc(x)


def test_a_model_neither_exporter_captures_whole_is_exported_as_its_trace_and_verified(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="core.onnx_export"):
        report = export_and_verify(_DataDependent(), torch.randn(8, 4), tmp_path / "m.onnx", latency_runs=1)
    assert report.passed and report.exporter == "torchscript"
    assert "follows one path through data-dependent code" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


class _LogAddExp(nn.Module):
    """``torch.logaddexp``: the TorchScript exporter has no translation for it, the dynamo one has."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.fc(x)
        return torch.logaddexp(y, 2 * y)


def test_a_model_the_torchscript_exporter_cannot_handle_goes_to_the_dynamo_exporter(tmp_path):
    torch.manual_seed(0)
    model = _LogAddExp()
    report = export_and_verify(model, torch.randn(8, 4), tmp_path / "m.onnx", latency_runs=1)
    assert report.passed and report.exporter == "dynamo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    session = ort.InferenceSession(str(report.path), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 4)
    (out,) = session.run(["logits"], {"input": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), atol=1e-5)


def test_an_unknown_exporter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="exporter must be one of"):
        export_and_verify(nn.Linear(4, 2), torch.randn(4, 4), tmp_path / "m.onnx", exporter="fast")
