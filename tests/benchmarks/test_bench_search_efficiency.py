"""The search-efficiency benchmark's bookkeeping, on made-up study summaries (the studies
themselves take minutes; `make bench` runs them): which pruner each copy of the spec gets, and
how epochs and accuracy gaps add up over seeds. The spec's own pruner is judged; compared ones
are reported without a verdict."""
from __future__ import annotations

import pytest
import yaml

from benchmarks.bench_search_efficiency import NONE, OWN, SPEC, arm_row, pruner_label, variant


def summary(epochs: int, acc: float) -> dict:
    return {"epochs_trained": epochs, "best_val_acc": acc}


def test_variants_change_only_name_seed_pruner_and_export():
    base = yaml.safe_load(SPEC.read_text())
    spec = variant(base, 7, "compare0", {"name": "median", "warmup_epochs": 2}, quick=False)
    assert spec["name"] == "lr_bs_seed7_compare0" and spec["sampler"] == {**base["sampler"], "seed": 7}
    assert spec["pruner"] == {"name": "median", "warmup_epochs": 2}
    assert spec["train"] == {**base["train"], "export_onnx": False}
    assert (spec["search"], spec["budget"], spec["objective"]) == (base["search"], base["budget"], base["objective"])
    assert base["pruner"] == yaml.safe_load(SPEC.read_text())["pruner"]  # the copy left the spec it came from alone

    quick = variant(base, 0, OWN, {"name": "median", "warmup_epochs": 2}, quick=True)
    assert quick["train"]["epochs"] == 3 and quick["budget"]["n_trials"] == 3
    assert quick["pruner"]["warmup_epochs"] == 1  # 3 epochs leave room to prune after the first


def test_pruner_labels():
    assert pruner_label({"name": "none"}) == "none"
    assert pruner_label({"name": "asha", "min_resource": 1, "reduction_factor": 3}) == \
        "asha (min_resource 1, reduction_factor 3)"


def test_rows_sum_epochs_over_seeds_and_judge_only_the_spec_pruner():
    seeds = {
        0: {OWN: summary(40, 0.99), NONE: summary(96, 0.995), "compare0": summary(60, 0.995)},
        1: {OWN: summary(56, 0.98), NONE: summary(96, 0.99), "compare0": {"error": "sweeps run exited 1"}},
        2: {OWN: summary(48, 1.0), NONE: {"error": "timed out"}},
    }
    judged = arm_row("all seeds ({n})", "asha", seeds, OWN, judged=True)
    assert judged["case"] == "all seeds (2)" and judged["details"]["seeds"] == [0, 1]  # seed 2 has no baseline
    assert judged["details"]["epochs_ratio_total"] == pytest.approx(96 / 192)
    assert judged["details"]["accuracy_gaps"] == pytest.approx([0.005, 0.01])
    # 0.5x the epochs passes; the median gap, 0.75 points, does not.
    assert judged["meets_target"] is False and judged["target"]
    assert judged["candidate"]["median"] == 48 and judged["baseline"]["median"] == 96

    compared = arm_row("compared, all seeds ({n})", "median", seeds, "compare0", judged=False)
    assert compared["case"] == "compared, all seeds (1)"  # the failed study is left out, not counted as 0
    assert compared["details"]["epochs_ratio_total"] == pytest.approx(60 / 96)
    assert compared["meets_target"] is None and compared["target"] is None
