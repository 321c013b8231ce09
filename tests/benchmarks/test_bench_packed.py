"""The packed benchmark at tiny sizes, GPU case included (run on CPU here): every arm (sweeps run
packed, unpacked, the plain script) finishes its trials and keeps every record. Speed is never
asserted."""
from __future__ import annotations

import json

import pytest

from benchmarks.common import bench_main
from tests.benchmarks.test_bench_smoke import check_schema

pytestmark = pytest.mark.slow


def test_packed_quick_every_arm_keeps_every_record_and_the_gpu_case_runs_on_cpu(tmp_path):
    out = tmp_path / "packed.json"
    tiny = {"n_trials": 2, "epochs": 1}
    overrides = {"diabetes_mlp": tiny, "resnet18_synthetic": tiny}
    assert bench_main(["packed", "--quick", "--out", str(out), "--opt", 'cases=["diabetes_mlp", "resnet18_synthetic"]',
                       "--opt", "gpu_case_on_cpu=true", "--opt", f"case_overrides={json.dumps(overrides)}"]) == 0
    result = json.loads(out.read_text())
    check_schema(result, "packed")
    assert [r["case"] for r in result["rows"]] == [
        "diabetes_mlp: packed vs script", "diabetes_mlp: packed vs unpacked",
        "resnet18_synthetic: packed vs script", "resnet18_synthetic: packed vs unpacked",
        "diabetes_mlp: training loop alone, 2 members"]
    assert result["rows"][0]["target"] == ">= 2.0x, every record, best as good"
    for case, runs in result["details"]["runs"].items():
        assert set(runs) == {"packed", "unpacked", "script"}
        for which, (res,) in runs.items():
            assert "error" not in res, (case, which, res.get("error"))
            assert res["records"] == res["trials"] == 2, (case, which)  # every trial with its whole curve
            assert res["best"] is not None and res["gpu_util_pct"] is None  # no GPU to sample here
