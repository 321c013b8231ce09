"""The diagnostics keys in a spec (train.profile, train.export_torchscript, train.detect_anomaly,
task.args.checkpoint_blocks): off by default; a mistake exits 2 naming the file, key, value and fix."""
from __future__ import annotations

import pytest
import yaml

from core.config import TrainConfig
from sweeps import cli


def test_every_diagnostic_is_off_by_default():
    cfg = TrainConfig()
    assert (cfg.profile, cfg.export_torchscript, cfg.detect_anomaly) == (None, None, False)


@pytest.mark.parametrize("section, message", [
    ({"train": {"profile": {"active": 0}}}, "train.profile.active: 0 is out of range; use 1 or more steps"),
    ({"train": {"profile": {"wiat": 1}}}, "train.profile.wiat: unknown field. Did you mean 'wait'?"),
    ({"train": {"profile": 3}}, "train.profile: expected a mapping (or null to turn it off), got 3"),
    ({"train": {"export_torchscript": "jit"}}, "train.export_torchscript: 'jit' is not one of trace, script"),
    ({"train": {"detect_anomaly": "yes"}}, "train.detect_anomaly: expected true or false, got 'yes'"),
    ({"search": {"profile": {"type": "categorical", "choices": [1]}}},
     "search.profile: a nested section cannot be searched; set train.profile instead"),
    ({"task": {"name": "synthetic", "args": {"checkpoint_blocks": "layer1"}}},
     "checkpoint_blocks is 'layer1'; give a list of submodule names"),
])
def test_a_mistake_exits_2_with_file_key_value_and_fix(tmp_path, capsys, section, message):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "keys", "task": {"name": "digits"}, **section}))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err and "Traceback" not in err


def test_the_keys_together_validate(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "name": "keys", "task": {"name": "synthetic", "model": "resnet18", "args": {"checkpoint_blocks": ["layer1"]}},
        "train": {"profile": {"wait": 0, "active": 2}, "export_torchscript": "script", "detect_anomaly": True}}))
    assert cli.main(["validate", str(path)]) == 0
