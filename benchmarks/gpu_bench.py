"""GPU benchmarks (section 8 of benchmarks/README.md): what a user checks before handing sweeps a GPU.

    python benchmarks/gpu_bench.py            # CUDA machine: a few minutes
    python benchmarks/gpu_bench.py --dry-run  # CPU, tiny sizes: every code path, no numbers worth reading

Imports only ``core`` (torch, torchvision, numpy), so it runs on a bare GPU image without the
sweeps stack. Every figure is a ratio against a baseline measured in the same run:

* ``trainer``: samples/s of ``core.train()`` against minimal hand-written CUDA loops (same
  ResNet-18 at 32x32, bf16 autocast, batch, data, steps), arms alternated, with the GPU
  utilisation NVML reports for each: the usual hand loop (pinned DataLoader, a copy per step)
  and the device-resident one (tensors on the GPU once, batches sliced there), which is how
  core feeds an in-memory dataset; against the latter the ratio measures core's own per-step work.
* ``dataloader``: ImageFolder on PNGs this script writes (decode + RandomResizedCrop + flip per
  sample, the CPU work a real image task has) for each ``num_workers`` x ``pin_memory``:
  samples/s and the mean GPU utilisation NVML reports while the second epoch trains.
* ``trials_per_gpu``: one trial process alone on the GPU against two at once on the same GPU
  (what ``resources.gpus_per_trial: 0.5`` does): the pair's summed samples/s over the single's.
* ``optimizer``: one optimizer step of ResNet-18's parameters, PyTorch's default implementation
  (foreach on CUDA) against the fused one, for SGD with momentum and AdamW. core uses the fused
  kernels on CPU only (core/optim.py); this is the measurement that would move them to GPUs.

Each section catches its own errors (a row with the error, the others still run) and the JSON is
rewritten after every section, so a run cut short still leaves what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_check import make_config  # noqa: E402
from core.config import TrainConfig  # noqa: E402
from core.reporting import NullReporter  # noqa: E402
from core.tasks.base import make_task  # noqa: E402
from core.train import train  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SIZES = {  # (CUDA, dry run on CPU)
    "gpu": dict(n_train=16384, batch=256, epochs=3, repeats=3, images=4096, image_px=80, image_size=64,
                img_batch=128, workers=(0, 4, 8), trial_epochs=4, optimizer_steps=50),
    "dry": dict(n_train=64, batch=16, epochs=2, repeats=1, images=48, image_px=40, image_size=32,
                img_batch=16, workers=(0, 2), trial_epochs=2, optimizer_steps=2),
}


# --------------------------------------------------------------------------- measuring helpers


class UtilSampler:
    """Samples NVML's GPU utilisation (percent of time a kernel ran, per ~1/6 s window) every
    50 ms on a thread; ``mean(t0, t1)`` averages the samples taken between two wall times.
    Without NVML (CPU dry run) every mean is None."""

    def __init__(self, index: int = 0) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - no NVML: utilisation is simply not reported
            return
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.samples.append((time.perf_counter(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception:  # noqa: BLE001
                return

    def mean(self, t0: float, t1: float) -> float | None:
        window = [u for t, u in self.samples if t0 <= t <= t1]
        return round(statistics.fmean(window), 1) if window else None

    def close(self) -> None:
        self._stop.set()


class EpochClock(NullReporter):
    """A core Reporter that stamps the wall time of each epoch's end (to window utilisation)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def report_epoch(self, epoch, step, metrics):
        self.ends.append(time.perf_counter())
        return super().report_epoch(epoch, step, metrics)


def steady_samples_per_s(history: list[dict]) -> float:
    """Mean samples/s of the epochs after the first (the first pays for cuDNN autotuning)."""
    steady = history[1:] or history
    return statistics.fmean(h["samples_per_s"] for h in steady)


def config(on_gpu: bool, **kw) -> TrainConfig:
    """gpu_check's run in bf16 on the GPU, without gradient clipping (a hand loop has none)."""
    return make_config(on_gpu, **{"precision": "bf16" if on_gpu else "fp32", "grad_clip": None, **kw})


def synthetic_task(n_train: int):
    return make_task("synthetic", model="resnet18", args={"shape": [3, 32, 32], "n_train": n_train, "n_val": 512})


# --------------------------------------------------------------------------- sections


def hand_loop(task, cfg: TrainConfig, sampler: UtilSampler, syncs: bool = False, resident: bool = False) -> dict:
    """The minimal CUDA loop: pinned DataLoader -> non-blocking copy -> autocast forward ->
    loss -> zero_grad -> backward -> step, no per-step sync. Steady-state samples/s and the GPU
    utilisation over those epochs.
    ``resident``: the fastest a hand loop feeds the GPU: the tensors moved to the device once,
    each batch sliced from them by a device-side permutation (no DataLoader, no copy per step).
    ``syncs``: also read loss, accuracy and grad norm every step with ``.item()`` (what core did
    before it read each step's numbers one step late): the price of three syncs per step."""
    from torch import nn
    from torch.utils.data import DataLoader

    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = task.build_model().to(device)
    train_ds, _ = task.datasets()
    if resident:
        x_all, y_all = train_ds.x.to(device), train_ds.y.to(device)

        def batches():
            return ((x_all[i], y_all[i]) for i in torch.randperm(len(x_all), device=device).split(cfg.batch_size))
    else:
        loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0,
                            pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(cfg.seed))

        def batches():
            return iter(loader)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    criterion = nn.CrossEntropyLoss()
    dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    rates, windows = [], []
    for _ in range(cfg.epochs):
        model.train()
        _sync(device)
        t0, seen = time.perf_counter(), 0
        for x, y in batches():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = model(x)
                loss = criterion(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if syncs:
                loss.item(), (logits.argmax(1) == y).sum().item()
                float(nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
            opt.step()
            seen += y.shape[0]
        _sync(device)
        t1 = time.perf_counter()
        rates.append(seen / (t1 - t0))
        windows.append((t0, t1))
    steady = windows[1:] or windows  # the first epoch pays for cuDNN autotuning
    return {"samples_per_s": statistics.fmean(rates[1:] or rates),
            "gpu_util_pct": sampler.mean(steady[0][0], steady[-1][1])}


def core_arm(task, cfg: TrainConfig, sampler: UtilSampler) -> dict:
    """``core.train()`` on the same run: its steady samples/s and the GPU utilisation over those epochs."""
    clock = EpochClock()
    history = train(task, cfg, reporter=clock).history
    return {"samples_per_s": steady_samples_per_s(history),
            "gpu_util_pct": sampler.mean(clock.ends[0], clock.ends[-1]) if len(clock.ends) > 1 else None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section_trainer(size: dict, on_gpu: bool, sampler: UtilSampler) -> dict:
    """core.train() against two hand loops: the DataLoader one (pinned memory, a copy per step) and
    the device-resident one (what core does for an in-memory dataset, ``core.in_memory``)."""
    task = synthetic_task(size["n_train"])
    cfg = config(on_gpu, epochs=size["epochs"], batch_size=size["batch"])
    arms = {"hand": lambda: hand_loop(task, cfg, sampler),
            "hand_resident": lambda: hand_loop(task, cfg, sampler, resident=True),
            "core": lambda: core_arm(task, cfg, sampler),
            "hand_with_3_syncs": lambda: hand_loop(task, cfg, sampler, syncs=True)}
    rounds = [{name: arm() for name, arm in arms.items()} for _ in range(size["repeats"])]  # arms alternated
    for r in rounds:
        r["ratio"] = r["core"]["samples_per_s"] / r["hand"]["samples_per_s"]
        r["ratio_resident"] = r["core"]["samples_per_s"] / r["hand_resident"]["samples_per_s"]
        r["syncs_ratio"] = r["hand_with_3_syncs"]["samples_per_s"] / r["hand"]["samples_per_s"]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    utils = {name: [r[name]["gpu_util_pct"] for r in rounds if r[name]["gpu_util_pct"] is not None] for name in arms}
    return {"what": "core.train() / hand loop samples/s, ResNet-18 32x32, "
                    f"{cfg.precision}, batch {cfg.batch_size}, {size['n_train']} samples x {cfg.epochs} epochs",
            "rounds": rounds, "ratio_median": median("ratio"), "ratio_min": min(r["ratio"] for r in rounds),
            "ratio_max": max(r["ratio"] for r in rounds), "ratio_resident_median": median("ratio_resident"),
            "ratio_resident_min": min(r["ratio_resident"] for r in rounds),
            "ratio_resident_max": max(r["ratio_resident"] for r in rounds),
            "syncs_ratio_median": median("syncs_ratio"),
            "gpu_util_pct_median": {name: statistics.median(u) if u else None for name, u in utils.items()}}


def write_images(root: Path, n: int, px: int, classes: int = 10) -> None:
    """PNG noise images under root/{train,val}/class_k (val: n // 8)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", n), ("val", max(classes, n // 8))):
        for i in range(count):
            folder = root / split / f"class_{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def section_dataloader(size: dict, on_gpu: bool, sampler: UtilSampler) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_bench_images_") as tmp:
        write_images(Path(tmp), size["images"], size["image_px"])
        task = make_task("imagefolder", model="resnet18", args={"root": tmp, "image_size": size["image_size"]})
        for workers in size["workers"]:
            for pin in (False, True):
                cfg = config(on_gpu, epochs=2, batch_size=size["img_batch"], num_workers=workers, pin_memory=pin)
                clock = EpochClock()
                try:
                    hist = train(task, cfg, reporter=clock).history
                except Exception as exc:  # noqa: BLE001 - a row with the error; the grid goes on
                    rows.append({"num_workers": workers, "pin_memory": pin, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                rows.append({"num_workers": workers, "pin_memory": pin,
                             "samples_per_s": hist[-1]["samples_per_s"],
                             "gpu_util_pct": (sampler.mean(clock.ends[0], clock.ends[-1]) if len(clock.ends) > 1
                                              else None)})
    done = [r for r in rows if "samples_per_s" in r]
    base = next((r for r in done if r["num_workers"] == 0 and not r["pin_memory"]), None)
    for r in done:
        r["speedup_vs_0_workers_unpinned"] = r["samples_per_s"] / base["samples_per_s"] if base else None
    return {"what": f"imagefolder PNG {size['image_px']}px -> RandomResizedCrop {size['image_size']} + flip, "
                    f"ResNet-18, batch {size['img_batch']}, epoch 2 of 2", "rows": rows}


def trial_worker(args_json: str) -> int:
    """One trial process (``--trial-worker``): train, print one JSON line."""
    a = json.loads(args_json)
    cfg = config(a["on_gpu"], epochs=a["epochs"], batch_size=a["batch"])
    started = time.perf_counter()
    hist = train(synthetic_task(a["n_train"]), cfg).history
    print(json.dumps({"samples_per_s": steady_samples_per_s(hist), "wall_s": time.perf_counter() - started}))
    return 0


def section_trials_per_gpu(size: dict, on_gpu: bool, sampler: UtilSampler) -> dict:
    args = json.dumps({"on_gpu": on_gpu, "epochs": size["trial_epochs"], "batch": size["batch"],
                       "n_train": size["n_train"]})

    def run(n: int) -> dict:
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--trial-worker", args],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
        outs = [p.communicate(timeout=300) for p in procs]
        t1 = time.perf_counter()
        for p, (_, err) in zip(procs, outs, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"a trial process exited {p.returncode}: {err.strip()[-800:]}")
        per = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        return {"processes": n, "samples_per_s_each": [p["samples_per_s"] for p in per],
                "samples_per_s_total": sum(p["samples_per_s"] for p in per),
                "wall_s": t1 - t0, "gpu_util_pct": sampler.mean(t0, t1)}

    one, two = run(1), run(2)
    return {"what": f"ResNet-18 32x32 trials ({size['n_train']} samples x {size['trial_epochs']} epochs, "
                    f"batch {size['batch']}), 1 process vs 2 at once on one GPU",
            "one": one, "two": two, "throughput_ratio": two["samples_per_s_total"] / one["samples_per_s_total"]}


# --------------------------------------------------------------------------- main


def section_optimizer(size: dict, on_gpu: bool) -> dict:
    from core.tasks.cifar10 import resnet18_cifar

    device = torch.device("cuda" if on_gpu else "cpu")
    params = [p.to(device) for p in resnet18_cifar(10).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    kinds = {"sgd": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}),
             "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2})}
    steps, out = size["optimizer_steps"], {}
    for name, (cls, kw) in kinds.items():
        ms: dict[str, list[float]] = {"default": [], "fused": []}
        optimizers = {"default": cls(params, **kw), "fused": cls(params, fused=True, **kw)}
        for _ in range(size["repeats"] + 1):  # ABAB; the first round (state allocation) discarded
            for arm, opt in optimizers.items():
                opt.step()
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    opt.step()
                _sync(device)
                ms[arm].append(1e3 * (time.perf_counter() - t0) / steps)
        default_ms, fused_ms = (statistics.median(v[1:]) for v in ms.values())
        out[name] = {"default_ms": default_ms, "fused_ms": fused_ms, "speedup": default_ms / fused_ms}
    return {"what": f"one step over ResNet-18's {sum(p.numel() for p in params) / 1e6:.1f}M parameters on "
                    f"{device.type}, median of {size['repeats']} blocks of {steps} steps", **out}


def environment(on_gpu: bool) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
           "cuda_available": torch.cuda.is_available(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if on_gpu:
        env.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(0),
                   device_count=torch.cuda.device_count())
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--only", default="trainer,dataloader,trials_per_gpu,optimizer", help="comma-separated sections")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--trial-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trial_worker is not None:
        return trial_worker(args.trial_worker)
    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("gpu_bench: skipped, no CUDA device is visible (run with --dry-run to exercise the code on CPU)")
        return 0
    if on_gpu:
        torch.backends.cudnn.benchmark = True
    size = SIZES["gpu" if on_gpu else "dry"]
    out = args.out or RESULTS / ("gpu_bench.json" if on_gpu else "gpu_bench.dry_run.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"dry_run": not on_gpu, "environment": environment(on_gpu), "sizes": size, "sections": {}}
    sampler = UtilSampler()
    sections = {"trainer": lambda: section_trainer(size, on_gpu, sampler),
                "dataloader": lambda: section_dataloader(size, on_gpu, sampler),
                "trials_per_gpu": lambda: section_trials_per_gpu(size, on_gpu, sampler),
                "optimizer": lambda: section_optimizer(size, on_gpu)}
    failed = False
    for name in [s.strip() for s in args.only.split(",") if s.strip()]:
        print(f"gpu_bench: {name} ...", flush=True)
        started = time.perf_counter()
        try:
            result = sections[name]()
        except Exception as exc:  # noqa: BLE001 - record it and go on with the next section
            failed = True
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["wall_s"] = round(time.perf_counter() - started, 1)
        report["sections"][name] = result
        print(json.dumps(result, default=str)[:2000], flush=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        os.replace(tmp, out)  # rewritten after every section: a cut-short run keeps what it measured
    sampler.close()
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
