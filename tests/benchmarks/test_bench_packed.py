"""The packed benchmark at tiny sizes, GPU case included (run on CPU here): every arm (sweeps run
packed, unpacked, the plain script) finishes its trials and keeps every record; and how its rows
compare the arms' best objectives seed by seed. Speed is never asserted."""
from __future__ import annotations

import json

import pytest

from benchmarks.bench_packed import CASES, _rows
from benchmarks.common import bench_main
from tests.benchmarks.test_bench_smoke import check_schema


@pytest.mark.slow
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
            assert res["packed"] == (2 if which == "packed" else 0), (case, which)  # one population of two
            # How the population runs, from its members' notes: the MLP as one model of grouped layers.
            assert sum(res["layouts"].values()) == res["packed"] and set(res["layouts"]) <= {"grouped layers", "vmap"}
            if case == "diabetes_mlp" and which == "packed":
                assert res["layouts"] == {"grouped layers": 2}
            assert res["best"] is not None and res["gpu_util_pct"] is None  # no GPU to sample here


def _run(seed: int, best: float | None, tpm: float = 60.0, records: int = 64) -> dict:
    return {"seed": seed, "best": best, "tpm": tpm, "records": records, "trials": 64, "gpu_util_pct": None}


def _failed(seed: int) -> dict:
    return {"seed": seed, "error": "exited 1"}


def test_arms_compare_seed_by_seed_and_a_round_failed_in_one_arm_drops_out_of_both():
    """val_rmse (lower is better). The script's round of seed 1 failed, so packed's seed 1 (a
    trial per minute, best 10) compares with nothing; on seeds 0, 2 and 3 packed is behind, ahead,
    ahead, and its median is the better one. Then behind on seeds 2 and 3: its median (53) is
    within the script's seeds (50 to 54) but worse than their median (52), so not as good."""
    runs = {"packed": [_run(0, 51.0, 120), _run(1, 10.0, 1), _run(2, 50.0, 120), _run(3, 53.0, 120)],
            "script": [_run(0, 50.0), _failed(1), _run(2, 52.0), _run(3, 54.0)],
            "unpacked": [_run(s, 50.0) for s in range(4)]}
    row = _rows("diabetes_mlp", CASES["diabetes_mlp"], runs)[0]
    best = row["details"]["best"]
    assert best["packed"] == [51.0, 50.0, 53.0] and best["base"] == [50.0, 52.0, 54.0]
    assert [round(d, 3) for d in best["behind_pct"]] == [2.0, -3.846, -1.852]
    assert best["median"] == {"packed": 51.0, "base": 52.0} and best["as_good"] is True
    assert row["ratio"]["median"] == 2.0 and row["meets_target"] is True  # seed 1's 1 trial/min left out
    assert "packed behind on 1 of 3, by -1.85% (median; -3.85% to +2.00%)" in row["headline"]

    runs["packed"][2], runs["packed"][3] = _run(2, 53.0, 120), _run(3, 55.0, 120)
    row = _rows("diabetes_mlp", CASES["diabetes_mlp"], runs)[0]
    assert row["details"]["best"]["as_good"] is False and row["meets_target"] is False

    runs["packed"][2] = _run(2, 50.0, 120, records=63)  # as good again, but a lost record
    assert _rows("diabetes_mlp", CASES["diabetes_mlp"], runs)[0]["meets_target"] is False
    runs["packed"][2] = _run(2, None, 120)  # a packed round that recorded no objective
    assert _rows("diabetes_mlp", CASES["diabetes_mlp"], runs)[0]["details"]["best"]["as_good"] is False


def test_a_maximized_objective_is_behind_when_lower_and_no_common_seed_is_an_error_row():
    runs = {"packed": [_run(0, 0.90), _run(1, 0.99)], "script": [_run(0, 0.95), _run(1, 0.90)],
            "unpacked": [_run(0, 0.90), _failed(1)]}
    by_base = {r["case"].rsplit(" ", 1)[1]: r for r in _rows("digits_cnn", CASES["digits_cnn"], runs)}
    best = by_base["script"]["details"]["best"]
    assert [round(d, 3) for d in best["behind_pct"]] == [5.263, -10.0] and best["as_good"] is True
    runs["packed"] = [_failed(0), _run(1, 0.99)]
    runs["unpacked"] = [_run(0, 0.90), _failed(1)]
    row = [r for r in _rows("digits_cnn", CASES["digits_cnn"], runs) if r["case"].endswith("unpacked")][0]
    assert row["status"] != "ok" and "no seed finished in both arms" in json.dumps(row)


def test_the_results_table_says_how_each_packed_arm_ran():
    from benchmarks.run_all import RESULTS_DIR, render

    result = json.loads((RESULTS_DIR / "packed.json").read_text())
    first, second = result["details"]["runs"]["diabetes_mlp"]["packed"][:2]
    first["layouts"] = {"vmap": 4, "grouped layers": 60}
    second.pop("layouts", None)  # a result written before the layouts were counted
    text = render([result], json.loads((RESULTS_DIR / "suite.json").read_text()))
    assert f"| diabetes_mlp | packed (60 as grouped layers, 4 as vmap) | {first['seed']} |" in text
    assert f"| diabetes_mlp | packed | {second['seed']} |" in text
