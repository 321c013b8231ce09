"""GPU check: a DDP ResNet-18 trial over NCCL, and fp16 / bf16 against fp32.

    .venv/bin/python benchmarks/gpu_check.py            # CUDA machine: a few minutes
    .venv/bin/python benchmarks/gpu_check.py --dry-run  # CPU, gloo, tiny sizes: every code path but fp16

What it runs (all through core.ddp_launch.train_distributed, the path a sweep trial takes):
  * fp32, bf16 and fp16 (GradScaler; skipped steps counted) on min(2, #GPUs) processes, NCCL when
    there are 2 GPUs, the same seed, data and global batch;
  * with 2 GPUs also fp32 on 1 GPU with the same per-process batch, for the DDP throughput ratio;
    with 1 GPU the NCCL row says it was skipped (NCCL refuses two ranks on one device);
  * exact resume on the device: deterministic=True, 2 epochs straight against 1 epoch, stop,
    resume, 1 more (in a fresh process, so CUBLAS_WORKSPACE_CONFIG is set before cuBLAS starts),
    and the ONNX export of the model trained there, verified against PyTorch by onnxruntime.
What it checks (exit 1 if one fails; the JSON is written either way):
  * every run completes;
  * the resumed weights equal the straight run's bit for bit; the ONNX export passes;
  * the last epoch's train loss of bf16 and fp16 is within ``--loss-rtol`` (relative) of fp32's;
  * fp16 skipped at most ``--max-skipped-frac`` of its optimizer steps for overflow.
Throughput ratios (bf16/fp32, fp16/fp32, 2 GPUs / 1 GPU) are reported, not judged.
Results: benchmarks/results/gpu_check.json (+ .md); a dry run writes gpu_check.dry_run.json (+ .md).
Without CUDA (and without --dry-run) it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from core.config import DistributedConfig, TrainConfig  # noqa: E402
from core.ddp_launch import TaskSpec, train_distributed  # noqa: E402
from core.reporting import Decision, NullReporter  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# Sizes: (GPU, dry run). The GPU run is ~3 epochs of 16k 32x32 images: seconds of compute per
# precision, the rest is process start-up and NCCL set-up.
SIZES = {
    "gpu": dict(shape=[3, 32, 32], n_train=16384, n_val=2048, batch_size=256, epochs=3, max_steps=None),
    "dry": dict(shape=[3, 16, 16], n_train=64, n_val=32, batch_size=8, epochs=2, max_steps=2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes (no fp16: it needs CUDA)")
    p.add_argument("--loss-rtol", type=float, default=0.10,
                   help="allowed relative gap of the final train loss to fp32's (default 0.10)")
    p.add_argument("--max-skipped-frac", type=float, default=0.10,
                   help="allowed fraction of fp16 steps skipped for overflow (default 0.10)")
    p.add_argument("--run-timeout", type=int, default=240, help="seconds per training run before it is stopped")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/gpu_check[.dry_run].json)")
    p.add_argument("--resume-check", action="store_true", help=argparse.SUPPRESS)  # the subprocess below
    return p.parse_args(argv)


def make_config(on_gpu: bool, **changes) -> TrainConfig:
    """The GPU scripts' run (this one and gpu_bench.py): SGD with momentum at a constant lr,
    no checkpoints or export, on the GPU or the CPU; ``changes`` on top."""
    base = dict(lr=0.05, optimizer="sgd", momentum=0.9, weight_decay=5e-4, scheduler="constant",
                device="cuda" if on_gpu else "cpu", num_workers=0, seed=0, save_checkpoints=False,
                export_onnx=False)
    return TrainConfig(**{**base, **changes})


class _Timeout(Exception):
    pass


def run_one(name: str, task: TaskSpec, cfg: TrainConfig, timeout_s: int) -> dict:
    """One training run; never raises: a failure is a row with its error."""
    def on_alarm(signum, frame):
        raise _Timeout(f"{name}: no result after {timeout_s} s")

    row = {"name": name, "precision": cfg.precision, "nproc": cfg.distributed.nproc,
           "backend": cfg.distributed.backend, "batch_per_process": cfg.batch_size}
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)  # the launcher's finally kills the ranks when this fires
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
            result = train_distributed(task, cfg, out_dir=out)
    except Exception as exc:  # noqa: BLE001 - report it, go on with the other runs
        row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return row
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    hist = result.history
    # Throughput of the epochs after the first (the first pays for cuDNN autotuning and warm-up).
    steady = hist[1:] or hist
    row.update(
        status=result.status, reason=result.reason, wall_s=round(time.monotonic() - started, 2),
        global_batch_size=result.global_batch_size, steps=result.steps_completed,
        skipped_steps=result.skipped_steps,
        final_train_loss=hist[-1]["train_loss"] if hist else math.nan,
        final_val_loss=hist[-1]["val_loss"] if hist else math.nan,
        final_val_acc=hist[-1]["val_acc"] if hist else math.nan,
        samples_per_s=sum(h["samples_per_s"] for h in steady) / max(len(steady), 1),
        peak_mem_mb=max((h["peak_mem_mb"] for h in hist), default=math.nan),
    )
    return row


class _StopAfterFirstEpoch(NullReporter):
    """Reporter that interrupts after epoch 1 (the checkpoint is written before the report)."""

    def report_epoch(self, epoch, step, metrics):
        return Decision.INTERRUPT


def resume_check(on_gpu: bool) -> dict:
    """``--resume-check`` (its own process): straight vs stop-and-resume on this device, then ONNX."""
    from core.tasks.base import make_task

    task = make_task("synthetic", model="resnet18", args={"shape": [3, 32, 32], "n_train": 2048 if on_gpu else 64,
                                                          "n_val": 256 if on_gpu else 32})
    cfg = TrainConfig(epochs=2, batch_size=128 if on_gpu else 16, lr=0.05, optimizer="sgd", momentum=0.9,
                      scheduler="onecycle", precision="fp32", device="cuda" if on_gpu else "cpu", num_workers=0,
                      seed=0, deterministic=True, save_checkpoints=True, export_onnx=False)
    from core.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory(prefix="gpu_check_resume_") as tmp:
        straight = train_distributed(task, cfg, out_dir=Path(tmp) / "a")
        first = train_distributed(task, cfg, out_dir=Path(tmp) / "b", reporter=_StopAfterFirstEpoch())
        resumed = train_distributed(task, cfg, out_dir=Path(tmp) / "b", resume=True)
        a = load_checkpoint(Path(tmp) / "a" / "last.pt")["model"]
        b = load_checkpoint(Path(tmp) / "b" / "last.pt")["model"]
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        onnx_cfg = dataclasses.replace(cfg, epochs=1, export_onnx=True)
        exported = train_distributed(task, onnx_cfg, out_dir=Path(tmp) / "c")
    onnx = exported.onnx
    return {"first_status": first.status, "resumed_status": resumed.status, "straight_steps": straight.steps_completed,
            "resumed_steps": resumed.steps_completed, "tensors": len(a), "tensors_differing": differ[:10],
            "bitwise_equal": not differ and resumed.steps_completed == straight.steps_completed,
            "onnx_passed": bool(onnx is not None and onnx.passed),
            "onnx_max_abs_diff": None if onnx is None else onnx.max_abs_diff}


def run_resume_check(on_gpu: bool, timeout_s: int) -> dict:
    import os
    import subprocess

    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--resume-check"] + ([] if on_gpu else ["--dry-run"])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result after {timeout_s} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-1500:]}"}
    return json.loads(lines[-1])


def check(rows: dict[str, dict], args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Pass/fail checks and the (unjudged) throughput ratios."""
    checks, ratios = [], {}
    for name, row in rows.items():
        if name != "resume_onnx" and row["status"] != "skipped":
            checks.append({"check": f"{name} completes", "passed": row["status"] == "completed",
                           "detail": row.get("error") or row.get("reason") or row["status"]})
    base = rows.get("fp32")
    for name in ("bf16", "fp16"):
        row = rows.get(name)
        if base is None or row is None or "completed" not in (row["status"], base["status"]) \
                or row["status"] != "completed" or base["status"] != "completed":
            continue
        gap = abs(row["final_train_loss"] - base["final_train_loss"]) / max(abs(base["final_train_loss"]), 1e-12)
        checks.append({"check": f"{name} final train loss within {args.loss_rtol:.0%} of fp32",
                       "passed": bool(gap <= args.loss_rtol),
                       "detail": f"{row['final_train_loss']:.4f} vs {base['final_train_loss']:.4f} (gap {gap:.1%})"})
        ratios[f"{name}_over_fp32_samples_per_s"] = row["samples_per_s"] / base["samples_per_s"]
    fp16 = rows.get("fp16")
    if fp16 is not None and fp16["status"] == "completed":
        frac = fp16["skipped_steps"] / max(fp16["steps"], 1)
        checks.append({"check": f"fp16 skipped at most {args.max_skipped_frac:.0%} of its steps",
                       "passed": bool(frac <= args.max_skipped_frac),
                       "detail": f"{fp16['skipped_steps']} of {fp16['steps']} steps skipped (GradScaler overflow)"})
    resume = rows.get("resume_onnx")
    if resume is not None:
        if "error" in resume:
            checks.append({"check": "exact resume and ONNX export on the device", "passed": False,
                           "detail": resume["error"]})
        else:
            checks.append({"check": "stop after epoch 1 + resume == 2 epochs straight, bit for bit",
                           "passed": bool(resume["bitwise_equal"]),
                           "detail": f"{resume['tensors']} tensors, "
                                     f"differing: {resume['tensors_differing'] or 'none'}; "
                                     f"steps {resume['resumed_steps']} vs {resume['straight_steps']}"})
            checks.append({"check": "ONNX export of the device-trained model verified by onnxruntime",
                           "passed": resume["onnx_passed"], "detail": f"max abs diff {resume['onnx_max_abs_diff']}"})
    one = rows.get("fp32_1proc")
    if base is not None and one is not None and base["status"] == one["status"] == "completed":
        ratios[f"fp32_{base['nproc']}proc_over_1proc_samples_per_s"] = base["samples_per_s"] / one["samples_per_s"]
    return checks, ratios


def environment(on_gpu: bool, nproc: int) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "cuda_available": torch.cuda.is_available(), "nproc": nproc}
    if on_gpu:
        env.update(cuda=torch.version.cuda,
                   devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                   bf16_supported=torch.cuda.is_bf16_supported())
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informative only
            env["nccl"] = "unknown"
    return env


def table(rows: dict[str, dict], checks: list[dict], ratios: dict) -> str:
    lines = ["| run | nproc | backend | status | final train loss | val acc | samples/s | skipped | peak MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name == "resume_onnx":
            continue
        if r["status"] in ("completed", "pruned", "interrupted"):
            lines.append(f"| {name} | {r['nproc']} | {r['backend']} | {r['status']} | {r['final_train_loss']:.4f} | "
                         f"{r['final_val_acc']:.3f} | {r['samples_per_s']:.0f} | {r['skipped_steps']} | "
                         f"{r['peak_mem_mb']:.0f} |")
        else:
            lines.append(f"| {name} | {r['nproc']} | {r['backend']} | {r['status']} | {r.get('error', '')} | | | | |")
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'PASS' if c['passed'] else 'FAIL'} | {c['detail']} |" for c in checks]
    if ratios:
        lines += ["", "| throughput ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.dry_run
    if args.resume_check:
        print(json.dumps(resume_check(on_gpu), default=str))
        return 0
    if not on_gpu and not args.dry_run:
        print("gpu_check: skipped, no CUDA device is visible (run with --dry-run to exercise the code on CPU)")
        return 0
    size = SIZES["gpu" if on_gpu else "dry"]
    nproc = min(2, torch.cuda.device_count()) if on_gpu else 2
    task = TaskSpec("synthetic", model="resnet18", args={"shape": size["shape"], "num_classes": 10,
                                                         "n_train": size["n_train"], "n_val": size["n_val"]})
    plan = [("fp32", "fp32", nproc), ("bf16", "bf16", nproc), ("fp16", "fp16", nproc)]
    rows: dict[str, dict] = {}
    if nproc > 1:
        plan.append(("fp32_1proc", "fp32", 1))
    else:
        rows["nccl_ddp"] = {"name": "nccl_ddp", "precision": "fp32", "nproc": 2, "backend": "nccl", "status": "skipped",
                            "error": f"{torch.cuda.device_count()} GPU on this machine: NCCL DDP needs 2 "
                                     "(it refuses two ranks on one device); DDP itself is tested on CPU with gloo"}
    for name, precision, n in plan:
        skip = None
        if precision == "fp16" and not on_gpu:
            skip = "fp16 needs CUDA (core.precision refuses it on CPU)"
        elif precision == "bf16" and on_gpu and not torch.cuda.is_bf16_supported():
            skip = "this GPU has no bf16"
        if skip:
            rows[name] = {"name": name, "precision": precision, "nproc": n, "backend": "-", "status": "skipped",
                          "error": skip}
            continue
        cfg = make_config(on_gpu, epochs=size["epochs"], batch_size=size["batch_size"],
                          max_steps_per_epoch=size["max_steps"], precision=precision,
                          distributed=DistributedConfig(nproc=n, backend=("nccl" if on_gpu else "gloo") if n > 1
                                                        else "auto"))
        print(f"gpu_check: {name} on {n} process(es) ...", flush=True)
        rows[name] = run_one(name, task, cfg, args.run_timeout)
    print("gpu_check: exact resume and ONNX export ...", flush=True)
    rows["resume_onnx"] = run_resume_check(on_gpu, args.run_timeout)
    checks, ratios = check(rows, args)
    report = {"dry_run": not on_gpu, "environment": environment(on_gpu, nproc), "sizes": size,
              "tolerances": {"loss_rtol": args.loss_rtol, "max_skipped_frac": args.max_skipped_frac},
              "runs": rows, "checks": checks, "ratios": ratios,
              "passed": all(c["passed"] for c in checks)}
    out = args.out or RESULTS / ("gpu_check.json" if on_gpu else "gpu_check.dry_run.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = table(rows, checks, ratios)
    out.with_suffix(".md").write_text(f"# gpu_check{' (dry run, CPU)' if not on_gpu else ''}\n\n{text}\n")
    print(text)
    print(f"\nwrote {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
