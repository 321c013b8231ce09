"""GPU section: runs ``benchmarks/gpu_check.py`` (another engineer's check: DDP ResNet-18 over NCCL,
fp16/bf16 against fp32) only where CUDA is present, and includes its JSON. On a CPU-only machine
it records that the section was skipped.

``--dry-run`` style: ``ctx.options["dry_run"]`` passes ``--dry-run`` to gpu_check (CPU, gloo, tiny
sizes), to exercise this wrapper without a GPU.
"""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import ROOT, Context, bench_main, error_row, make_row, sweeps_env

NAME = "gpu"
TITLE = "GPU section: benchmarks/gpu_check.py (DDP ResNet-18, fp16/bf16 vs fp32), CUDA only"
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


def run(ctx: Context) -> dict:
    import torch

    dry = bool(ctx.options.get("dry_run"))
    if not torch.cuda.is_available() and not dry:
        return {"status": "skipped", "target": "none (reported)",
                "summary": "GPU section skipped: no CUDA device on this machine (gpu_check.py runs only with CUDA)",
                "rows": [], "notes": ["torch.cuda.is_available() is False: benchmarks/gpu_check.py was not run."]}
    out = ctx.workdir / "gpu_check.json"
    cmd = [sys.executable, str(GPU_CHECK), "--out", str(out)] + (["--dry-run"] if dry else [])
    ctx.log(f"{NAME}: {' '.join(cmd[1:])}")
    timeout_s = int(ctx.options.get("timeout_s", 900))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=sweeps_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"target": "gpu_check's own checks pass", "summary": f"GPU section: gpu_check.py timed out after {timeout_s} s",
                "rows": [error_row("gpu_check.py", f"timed out after {timeout_s} s")]}
    if not out.exists():
        tail = (proc.stdout + proc.stderr)[-1500:]
        return {"target": "gpu_check's own checks pass",
                "summary": f"GPU section: gpu_check.py exited {proc.returncode} without a result",
                "rows": [error_row("gpu_check.py", f"exit {proc.returncode}; output tail:\n{tail}")]}
    report = json.loads(out.read_text())
    rows = []
    for key, value in report.get("ratios", {}).items():
        rows.append(make_row(key, metric="samples/s ratio", ratio={"median": value, "min": value, "max": value,
                                                                   "q1": value, "q3": value, "n": 1,
                                                                   "definition": key},
                             headline=f"{value:.2f}x"))
    for check in report.get("checks", []):
        rows.append(make_row(check["check"], metric="check", headline=check["detail"], target="pass",
                             meets_target=bool(check["passed"])))
    passed = report.get("passed")
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in report.get("ratios", {}).items())
    return {
        "target": "gpu_check's own checks pass (loss parity of bf16/fp16 with fp32, few skipped fp16 steps)",
        "summary": f"GPU section{' (dry run on CPU)' if report.get('dry_run') else ''}: gpu_check "
                   f"{'passed' if passed else 'FAILED'} (exit {proc.returncode})" + (f"; {ratios}" if ratios else ""),
        "rows": rows,
        "notes": ["Ratios and checks are gpu_check.py's own; its full report is under details.gpu_check."],
        "details": {"gpu_check": report, "exit_code": proc.returncode},
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(NAME, TITLE, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
