"""train.profile: torch.profiler over a few optimizer steps; the Chrome trace and the top-operator
table are written and logged; off by default, with no profiler at all."""
from __future__ import annotations

import json

import pytest

from core.config import ConfigError, ProfileConfig, TrainConfig, apply_overrides
from core.reporting import RecordingReporter
from core.tasks.digits import DigitsTask
from core.train import train
from tests.core.helpers import fast_config


def _steps_in(trace: dict) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})


def test_the_active_steps_are_traced_and_logged(tmp_path):
    rec = RecordingReporter()
    cfg = fast_config(epochs=1, max_steps_per_epoch=8, profile=ProfileConfig(wait=1, warmup=1, active=2, repeat=1))
    result = train(DigitsTask("mlp"), cfg, reporter=rec, out_dir=tmp_path)
    assert result.status == "completed"
    trace = json.loads((tmp_path / "profile" / "trace_1.json").read_text())
    # Steps 0 (wait) and 1 (warmup) are not recorded; 2 and 3 are, with the model's ops and their shapes.
    assert _steps_in(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::addmm" for e in ops)
    assert any("Input Dims" in e.get("args", {}) for e in ops)  # record_shapes
    table = (tmp_path / "profile" / "top_ops_1.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert [p.name for p, kind in rec.artifacts if kind == "profile"] == ["trace_1.json", "top_ops_1.txt"]
    assert not (tmp_path / "profile" / "trace_2.json").exists()


def test_each_repeat_writes_its_own_trace(tmp_path):
    cfg = fast_config(epochs=1, max_steps_per_epoch=6, profile=ProfileConfig(wait=0, warmup=1, active=2, repeat=3))
    train(DigitsTask("mlp"), cfg, out_dir=tmp_path)
    first = json.loads((tmp_path / "profile" / "trace_1.json").read_text())
    second = json.loads((tmp_path / "profile" / "trace_2.json").read_text())
    assert _steps_in(first) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert _steps_in(second) == ["ProfilerStep#4", "ProfilerStep#5"]
    assert not (tmp_path / "profile" / "trace_3.json").exists()  # the run ended in cycle 3's warmup


def test_off_by_default_nothing_is_profiled(tmp_path):
    assert TrainConfig().profile is None
    train(DigitsTask("mlp"), fast_config(epochs=1, max_steps_per_epoch=3), out_dir=tmp_path)
    assert not (tmp_path / "profile").exists()


def test_the_spec_mapping_and_its_mistakes():
    assert apply_overrides(TrainConfig(), {"profile": {}}).profile == ProfileConfig()
    assert apply_overrides(TrainConfig(), {"profile": {"active": 5}}).profile == ProfileConfig(active=5)
    assert apply_overrides(TrainConfig(), {"profile": None}).profile is None
    with pytest.raises(ConfigError, match=r"train.profile.active: 0 is out of range; use 1 or more steps"):
        apply_overrides(TrainConfig(), {"profile": {"active": 0}})
    with pytest.raises(ConfigError, match=r"train.profile.warmpu: unknown field. Did you mean 'warmup'\?"):
        apply_overrides(TrainConfig(), {"profile": {"warmpu": 1}})
    with pytest.raises(ConfigError, match=r"train.profile: expected a mapping \(or null to turn it off\), got 3"):
        apply_overrides(TrainConfig(), {"profile": 3})


def test_kinetos_own_log_lines_stay_out_of_the_runs_output(tmp_path, capfd):
    # Kineto writes "USDT:... profiler_start" and, without a GPU, "ERROR:... gpuGetDeviceCount failed"
    # straight to file descriptor 2 as it starts and stops a trace.
    from core.profiling import KINETO_LINE

    cfg = fast_config(epochs=1, max_steps_per_epoch=4, profile=ProfileConfig(wait=0, warmup=1, active=2, repeat=1))
    assert train(DigitsTask("mlp"), cfg, out_dir=tmp_path).status == "completed"
    assert (tmp_path / "profile" / "trace_1.json").exists()
    err = capfd.readouterr().err
    assert not [line for line in err.splitlines() if KINETO_LINE.match(line)], err


def test_kineto_quiet_passes_other_writes_on(capfd):
    import os

    from core.profiling import kineto_quiet

    with kineto_quiet():
        os.write(2, b"ERROR:2026-12-05 09:16:44 26753:26753 DeviceProperties.cpp:56] gpuGetDeviceCount failed\n"
                    b"a warning of the task's own\n")
    assert capfd.readouterr().err == "a warning of the task's own\n"
