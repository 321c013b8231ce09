"""``sweeps check SPEC``: a clean task passes, its overfit check stopping once one batch fits;
each planted bug (labels out of range, a model that ignores its input, augmentation leaking into
validation) exits 2 naming it."""
from __future__ import annotations

import re

import pytest

from core.sanity import OVERFIT_STEPS
from sweeps import cli
from sweeps.commands.study import first_point
from sweeps.spec.load import spec_from_dict

SEARCH = {"lr": {"type": "float", "low": 1.0e-3, "high": 0.1, "log": True},
          "batch_size": {"type": "categorical", "choices": [16, 32]}}


def _spec(tmp_path, task_section: dict) -> str:
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "check", "task": task_section, "search": SEARCH,
                                    "train": {"epochs": 1, "num_workers": 0}}))
    return str(path)


def test_first_point_is_each_ranges_low_end_and_each_first_choice():
    spec = spec_from_dict({"name": "s", "task": {"name": "digits"}, "search": SEARCH})
    assert first_point(spec.search) == {"lr": 1.0e-3, "batch_size": 16}


def _overfit_steps(out: str) -> int:
    return int(re.search(r"one batch overfits: loss \S+ -> \S+ in (\d+) steps", out).group(1))


def test_a_clean_task_passes_every_check_and_stops_once_one_batch_fits(tmp_path, capsys):
    code = cli.main(["check", _spec(tmp_path, {"name": "digits", "model": "cnn"})])
    out = capsys.readouterr().out
    assert code == 0, out
    assert 0 < _overfit_steps(out) < OVERFIT_STEPS  # stopped early: the check is short because it fits
    for check in ("data", "labels", "validation", "model", "input", "overfit"):
        assert f"ok      {check}" in out
    assert "one batch overfits: loss" in out and "ok in" in out
    assert "labels of the first 1024 train samples: 0..9; of the first 16 validation samples: " in out


@pytest.mark.parametrize("factory, needle", [
    ("labels_out_of_range",
     "labels of the first 1024 train samples span 1..10 but num_classes is 10: labels must be 0..9"),
    ("validation_labels_out_of_range",
     "labels of the first 16 validation samples span 3..10 but num_classes is 10: labels must be 0..9"),
    ("ignores_input", "the model gives the same output for every input of a batch: it ignores its input"),
    ("augmented_validation", "validation sample 0 differs each time it is read: random augmentation is "
                             "applied to validation"),
    # A task hook that raises is a finding naming the hook, not a crash of the command.
    ("no_data", "PROBLEM data       task.datasets(): task 'no_data': no data at /nowhere; put the files there"),
    ("model_typo", "PROBLEM model      task.build_model() raised AttributeError: module 'torch.nn' has no "
                   "attribute 'Linera'; fix the task's build_model()"),
    ("nan_inputs", "PROBLEM finite     task 'digits': its train dataset (digits-train) holds 4 NaN or infinite "
                   "values (4 in its inputs), in 3 of its 1437 samples (the first: sample 5): a problem of the data"),
])
def test_each_planted_bug_exits_2_naming_it(tmp_path, capsys, factory, needle):
    code = cli.main(["check", _spec(tmp_path, {"target": f"tests.sweeps.check_tasks:{factory}"})])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert needle in captured.err and "Traceback" not in captured.err + captured.out
    assert "full traceback" not in captured.err
    assert "problem" in captured.err and "fix them before the sweep" in captured.err


@pytest.mark.slow
def test_the_shipped_segmentation_study_passes(capsys):
    """Its tiny U-Net needs about 300 steps of Adam at 1e-3 to overfit one batch 10x (200 steps failed
    it; on a CPU too busy for 300 steps in 20 s the check says inconclusive, and still exits 0)."""
    code = cli.main(["check", "studies/shapes_seg.yaml"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ok      overfit" in captured.out and "PROBLEM" not in captured.err
    assert 0 < _overfit_steps(captured.out) < OVERFIT_STEPS


def test_a_model_that_cannot_fit_one_batch_fails_the_overfit_check(tmp_path, capsys):
    code = cli.main(["check", _spec(tmp_path, {"name": "digits", "model": "mlp"}), "--steps", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "PROBLEM overfit" in err and "in 2 steps" in err


def test_bad_options_exit_2_with_the_fix(tmp_path, capsys):
    assert cli.main(["check", _spec(tmp_path, {"name": "digits"}), "--factor", "1"]) == 2
    assert "use --steps 1 or more and --factor above 1" in capsys.readouterr().err


def test_export_torchscript_is_tried_before_the_sweep(tmp_path, capsys):
    import yaml

    path = _spec(tmp_path, {"name": "digits", "model": "mlp"})
    data = yaml.safe_load(open(path))
    data["train"]["export_torchscript"] = "script"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    assert cli.main(["check", path]) == 0
    assert "ok      torchscript script export matches eager" in capsys.readouterr().out


def test_the_overfit_batch_cuts_each_tensor_of_a_structured_batch():
    import torch

    from core.sanity import OVERFIT_SAMPLES, _head

    batch = {"image": torch.zeros(16, 3), "extra": (torch.zeros(16), torch.zeros(16, 2)), "name": "kept"}
    cut = _head(batch)
    assert cut["image"].shape == (OVERFIT_SAMPLES, 3) and cut["name"] == "kept"
    assert [t.shape[0] for t in cut["extra"]] == [OVERFIT_SAMPLES] * 2 and isinstance(cut["extra"], tuple)


def test_label_smoothing_does_not_fail_the_overfit_check(tmp_path, capsys):
    """At 0.1 over 10 classes the smoothed loss cannot fall below about 0.5: 10x from 2.5 is out of reach."""
    import yaml

    path = _spec(tmp_path, {"name": "digits", "model": "cnn"})
    data = yaml.safe_load(open(path))
    data["train"]["label_smoothing"] = 0.1
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    code = cli.main(["check", path])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ok      overfit    one batch overfits" in captured.out


def test_an_easy_three_class_task_with_a_linear_model_passes_the_overfit_check(tmp_path, capsys):
    # ln 3 = 1.1 to start, and a linear model's loss falls slowly once every sample is right: a 10x
    # fall within 500 steps is not reached, yet the batch is fitted.
    code = cli.main(["check", _spec(tmp_path, {"target": "tests.sweeps.check_tasks:ThreeBlobs"})])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ok      overfit    one batch overfits: every one of its 8 samples predicted right after " in out
    assert "ok      labels     labels of the first 600 train samples: 0..2; of the first 16 validation " \
           "samples: 0..2, within 0..2" in out


def test_a_classification_task_without_num_classes_is_refused_naming_it(tmp_path, capsys):
    code = cli.main(["check", _spec(tmp_path, {"target": "tests.sweeps.check_tasks:ThreeBlobsWithoutNumClasses"})])
    captured = capsys.readouterr()
    assert code == 2, captured.out
    assert ("PROBLEM task       task 'ThreeBlobsWithoutNumClasses' keeps the default metrics() (accuracy over "
            "num_classes classes) but its num_classes is 0: set num_classes on the task") in captured.err
    assert "overfit" not in captured.out + captured.err  # refused before any data is read
