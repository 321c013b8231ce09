"""The benchmark code paths at tiny sizes, so they cannot rot: two cheap benchmarks through their
command line (quick mode), the result schema, the RESULTS.md table, and run_all end to end on the
GPU section (skipped at once without CUDA). Speed is never asserted."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.common import ROOT, bench_main, stats
from benchmarks.run_all import BENCHMARKS, collect, render
from core.metrics import LOOP_METRICS

pytestmark = pytest.mark.slow

RESULT_KEYS = {"schema", "name", "title", "mode", "status", "error", "started_at", "wall_s", "machine", "load",
               "target", "summary", "rows", "notes", "details"}
ROW_KEYS = {"case", "status", "error", "metric", "baseline", "candidate", "ratio", "headline", "target",
            "meets_target", "details"}
STATS_KEYS = {"median", "min", "max", "q1", "q3", "n"}


def check_schema(result: dict, name: str) -> None:
    assert RESULT_KEYS <= set(result), RESULT_KEYS - set(result)
    assert result["name"] == name and result["schema"] == 1 and result["mode"] == "quick"
    assert result["status"] == "ok", result["error"]
    assert result["summary"] and result["target"]
    machine = result["machine"]
    for key in ("cpu_model", "cpu_count", "ram_gib", "date", "versions"):
        assert machine[key], key
    for pkg in ("python", "torch", "optuna", "mlflow", "ray"):
        assert pkg in machine["versions"]
    assert result["rows"]
    for row in result["rows"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["status"] == "ok" and row["headline"]
        assert STATS_KEYS <= set(row["ratio"]) and row["ratio"]["definition"]
        assert row["ratio"]["n"] >= 1 and row["ratio"]["median"] > 0
        for side in ("baseline", "candidate"):
            assert STATS_KEYS <= set(row[side]) and row[side]["label"] and row[side]["median"] > 0


def test_onnx_latency_and_tracking_overhead_quick(tmp_path):
    out = tmp_path / "results"
    assert bench_main(["onnx_latency", "--quick", "--out", str(out / "onnx_latency.json"),
                                    "--opt", 'models=["digits_cnn"]', "--opt", "batches=[1]"]) == 0
    onnx = json.loads((out / "onnx_latency.json").read_text())
    check_schema(onnx, "onnx_latency")
    assert [r["case"] for r in onnx["rows"]] == ["digits_cnn batch 1"]
    assert onnx["details"]["exports"]["digits_cnn"]["parity_passed"] is True

    assert bench_main(["tracking_overhead", "--quick", "--out", str(out / "tracking_overhead.json"),
                                         "--opt", 'case={"epochs": 1, "max_steps": 3}']) == 0
    tracking = json.loads((out / "tracking_overhead.json").read_text())
    check_schema(tracking, "tracking_overhead")
    paced, whole = tracking["rows"][:2]
    assert (paced["case"], whole["case"]) == ("tracked vs off, lockstep", "tracked vs off, whole runs")
    assert paced["target"] and whole["target"] is None  # judged in lockstep; whole runs are the cross-check
    assert paced["details"]["step_pairs_per_run"] == 2  # 3 steps: no hand step against each epoch's first
    assert len(paced["details"]["costs"]["off"]) == len(paced["details"]["costs"]["tracked"]) >= 1
    for row in (paced, whole):
        assert row["details"]["all_runs_complete"] is True  # every step's points are in the store
    per_epoch = len(LOOP_METRICS) + 1  # the loop's own metrics and the digits task's val_acc
    assert paced["details"]["points"][-1] == {"found": 3 * 3 + per_epoch, "expected": 3 * 3 + per_epoch}
    points = whole["details"]["points"]
    assert points["found"] == points["expected"] == 3 * 3 + per_epoch
    assert points["per_key"]["step/train_loss"] == 3

    md = render(collect(out), None)
    assert "| 2 | tracking_overhead | tracked vs off, lockstep |" in md
    assert "| 7 | onnx_latency | digits_cnn batch 1 |" in md
    assert "Quick mode" in md and "## Machine" in md and "torch " in md


def test_trainer_overhead_quick_measures_in_lockstep_and_whole_runs(tmp_path):
    out = tmp_path / "trainer_overhead.json"
    assert bench_main(["trainer_overhead", "--quick", "--out", str(out), "--opt", 'cases=["digits_cnn"]']) == 0
    result = json.loads(out.read_text())
    check_schema(result, "trainer_overhead")
    paced, whole = result["rows"]
    assert (paced["case"], whole["case"]) == ("digits_cnn lockstep", "digits_cnn whole runs")
    assert paced["target"] == ">= 0.97" and whole["target"] is None  # the digits CNN is judged in lockstep
    details = paced["details"]
    assert details["step_pairs_per_run"] >= 1
    assert len(details["ratios"]["tracked"]) == len(details["ratios"]["untracked"]) >= 1
    assert details["step_ms"]["hand"]["n"] == 2 * details["step_ms"]["tracked"]["n"]  # a hand step per core step
    assert "grad norm: StepGradients.norm() (pooled small gradients + per-tensor large ones)" in \
        whole["details"]["breakdown"]["per_step_costs_us"]
    assert any("The training diagnostics are off" in note for note in result["notes"])


def test_trainer_overhead_measures_core_with_every_diagnostic_off(tmp_path):
    from benchmarks import bench_trainer_overhead as bench
    from benchmarks.common import Context

    for case in bench.cases(Context(quick=False, workdir=tmp_path)).values():
        cfg = bench.train_config(case)
        assert (cfg.profile, cfg.export_torchscript, cfg.detect_anomaly) == (None, None, False)
        assert not bench.make_task(case["task"]).checkpoint_blocks


def test_run_all_writes_results_and_markdown(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick", "--only", "gpu",
                           "--out-dir", str(tmp_path / "results")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gpu = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert gpu["name"] == "gpu" and gpu["status"] in ("skipped", "ok", "partial")
    md = (tmp_path / "RESULTS.md").read_text()
    assert "| 8 | gpu |" in md


def test_stats_and_unknown_benchmark():
    s = stats([3.0, 1.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 4.0, 4)
    assert s["q1"] <= s["median"] <= s["q3"]
    assert set(BENCHMARKS) == {"trainer_overhead", "tracking_overhead", "orchestration", "parallel",
                               "search_efficiency", "lr_finder", "onnx_latency", "gpu", "peers",
                               "thousand_trials", "packed"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--only", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr


def test_gpu_section_reports_the_stored_device_results_as_not_measured_here(tmp_path, monkeypatch):
    """On a CPU machine the GPU section shows the JSON the last GPU run wrote, labelled as such."""
    import torch

    from benchmarks import bench_gpu
    from benchmarks.common import RESULTS_DIR

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, on any machine
    check = json.loads((RESULTS_DIR / "gpu_check.json").read_text())
    bench = json.loads((RESULTS_DIR / "gpu_bench.json").read_text())

    class Ctx:
        options: dict = {}
        workdir = tmp_path

        def log(self, msg):
            pass

    result = bench_gpu.run(Ctx())
    assert "NOT measured in this run" in result["summary"] and "NVIDIA H200" in result["summary"]
    rows = {r["case"]: r for r in result["rows"]}
    trainer = rows["gpu_bench: core.train() vs hand CUDA loop"]
    assert trainer["ratio"]["median"] == pytest.approx(bench["sections"]["trainer"]["ratio_median"])
    check_rows = [c for c in rows if c.startswith("gpu_check: ") and rows[c]["metric"] == "check"]
    assert len(check_rows) == len(check["checks"])
    assert rows["gpu_check: nccl_ddp"]["status"] == "skipped"

    monkeypatch.setattr(bench_gpu, "RESULTS", tmp_path / "none")
    assert bench_gpu.run(Ctx())["status"] == "skipped"


def test_trainer_overhead_lockstep_with_tracked_runs_only(tmp_path):
    """ResNet-18's lockstep setting (its runs all tracked) on the digits CNN's tiny sizes."""
    from benchmarks import bench_trainer_overhead
    from benchmarks.common import Context
    from benchmarks.sweeps_runs import TrackingStore

    ctx = Context(quick=True, workdir=tmp_path)
    case = {"task": ("digits", {"model": "cnn"}), "batch_size": 32,
            "lockstep": {"epochs": 1, "max_steps": 4, "runs": 2, "arms": ("tracked",)}}
    paced = bench_trainer_overhead.lockstep(bench_trainer_overhead.make_task(case["task"]), case,
                                            TrackingStore(tmp_path / "mlflow"), "tiny", ctx)
    assert list(paced["ratios"]) == ["tracked"] and len(paced["ratios"]["tracked"]) == 2
    assert paced["step_pairs_per_run"] == 3  # the first step of a run has no pair
    # Speed is not asserted: each run's ratio is measured (a positive number) from every step pair.
    assert all(math.isfinite(r) and r > 0 for r in paced["ratios"]["tracked"])
    assert paced["step_ms"]["tracked"]["n"] == paced["step_ms"]["hand"]["n"] == 2 * 3


STALLING_BENCH = '''
import time
from benchmarks.common import arm, make_row, paired_ratio

NAME, TITLE = "stalling", "A benchmark that stalls"

def run(ctx):
    rows = [make_row("first case", metric="s", baseline=arm("a", [1.0, 1.2]), candidate=arm("b", [2.0, 2.2]),
                     ratio=paired_ratio([2.0, 2.2], [1.0, 1.2], "b / a"), headline="measured before the stall")]
    ctx.keep(rows)
    while True:  # the second case never ends: the suite stops it at its time limit
        time.sleep(1)
'''


@pytest.mark.timeout(300)  # a hang guard: a job never stopped at its limit would be waited for until then
def test_a_benchmark_stopped_at_its_time_limit_keeps_the_rows_it_had_measured(tmp_path, monkeypatch):
    """run_all stops an overrunning benchmark's process group; the rows it saved with ctx.keep are
    reported (status partial, the limit named) instead of nothing."""
    from benchmarks.run_all import Job

    (tmp_path / "stalling_bench.py").write_text(STALLING_BENCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "results" / "stalling.json"
    job = Job("stalling", out, quick=True, repeats=None, timeout_s=8, extra=[], log_path=None,
              module="stalling_bench")
    try:
        while not job.poll():  # the benchmark itself never ends: only its limit stops it
            time.sleep(0.2)
    finally:
        if job.proc.poll() is None:  # the test failed (timed out): leave nothing behind
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
    result = job.finish()
    assert result["status"] == "partial"
    assert result["error"].startswith("stopped after 8 s, its time limit in this suite")
    assert [r["case"] for r in result["rows"]] == ["first case"]
    assert result["rows"][0]["ratio"]["median"] == pytest.approx((2.0 / 1.0 + 2.2 / 1.2) / 2)
    assert "measured before the stall" in result["summary"] and "stopped after 8 s" in result["summary"]
    assert job.proc.returncode is not None  # the process is gone


def test_gpu_trainer_rows_compare_core_with_each_hand_loop_and_give_each_arms_utilisation():
    """gpu_bench's trainer section (its rounds): a row per hand loop, ratio and target from that
    loop, the GPU utilisation of core and of that loop in the headline."""
    from benchmarks.bench_gpu import trainer_rows

    def arm(rate, util):
        return {"samples_per_s": rate, "gpu_util_pct": util}

    rounds = [{"hand": arm(100.0, 40.0), "hand_resident": arm(200.0, 90.0), "core": arm(190.0, 88.0),
               "hand_with_3_syncs": arm(75.0, 30.0), "ratio": 1.9, "ratio_resident": 0.95, "syncs_ratio": 0.75}]
    t = {"what": "ResNet-18", "rounds": rounds, "ratio_median": 1.9, "ratio_resident_median": 0.95,
         "syncs_ratio_median": 0.75,
         "gpu_util_pct_median": {"hand": 40.0, "hand_resident": 90.0, "core": 88.0, "hand_with_3_syncs": 30.0}}
    loader, resident = trainer_rows(t)
    assert loader["ratio"]["median"] == 1.9 and loader["meets_target"] is True
    assert resident["ratio"]["median"] == 0.95 and resident["meets_target"] is False
    assert "GPU util 88.0% (core) vs 40.0% (hand)" in loader["headline"]
    assert "GPU util 88.0% (core) vs 90.0% (hand)" in resident["headline"]
    assert resident["baseline"]["median"] == 200.0 and resident["candidate"]["median"] == 190.0
