"""Packed trials (``resources.pack``): trials per minute of a study of small models trained as
populations, against the same study unpacked and against a plain Optuna + MLflow script.

Arms, each one whole study end to end (start-up included), on the same trials:
* ``sweeps run`` with ``resources.pack: 16`` (workers: auto);
* ``sweeps run`` without pack (workers: auto), the same spec otherwise;
* the plain script (``benchmarks/peers/task_script.py``): the task's own model, data, loss and
  metrics in a hand loop, TPE and ``MlflowClient``, one trial at a time (1 torch thread).

Cases: (a) the diabetes MLP (width 64, 40 epochs, lr x weight decay, 64 trials; both ``sweeps``
arms checkpoint every 10 epochs, ``train.checkpoint_every``, as studies/diabetes_pack.yaml does;
the script saves its best weights without fsync, as a plain script does), (b) the digits
CNN, (c) the shapes U-Net; on a GPU also (d) ResNet-18 at CIFAR size on synthetic data, with the
GPU's utilisation sampled during each arm (``nvidia-smi``). Every arm's records are counted (a
trial run with its whole epoch curve) and its best objective kept, so speed is never bought with
lost records or worse results. Round r of ``--repeats`` runs every arm with seed r (the sampler's
and the training's), so the best objectives compare across as many seeds as rounds: a single seed's
best depends on the order in which the sampler saw the trials, packed or not, and the arms
compare seed by seed.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import Context, alternate, arm, error_row, make_row, paired_ratio
from benchmarks.sweeps_runs import run_sweeps, sweeps_env, tiny_spec, write_spec

NAME = "packed"
TITLE = "Packed trials: trials/min of small-model studies trained as populations (resources.pack)"
TARGET = 2.0  # the diabetes study, pack 16, against the best plain-script arm (issue 41)
PACK = 16

# name -> the study: task, train settings, search ranges (lr and weight decay), objective, trials.
CASES: dict[str, dict] = {
    "diabetes_mlp": {"task": {"name": "diabetes", "model": "mlp", "args": {"width": 64, "depth": 2}},
                     "epochs": 40, "batch_size": 32, "optimizer": "adamw", "n_trials": 64,
                     "lr": [1e-4, 1e-1], "weight_decay": [1e-5, 1.0], "objective": "val_rmse",
                     "direction": "minimize", "checkpoint_every": 10},
    "digits_cnn": {"task": {"name": "digits", "model": "cnn", "args": {"val_fraction": 0.2}},
                   "epochs": 3, "batch_size": 32, "optimizer": "sgd", "n_trials": 16,
                   "lr": [1e-3, 0.3], "weight_decay": [1e-5, 1e-2], "objective": "val_acc", "direction": "maximize"},
    "shapes_unet": {"task": {"name": "shapes", "model": "unet", "args": {"width": 16, "n_train": 256, "n_val": 64}},
                    "epochs": 2, "batch_size": 32, "optimizer": "adamw", "n_trials": 16,
                    "lr": [1e-4, 3e-2], "weight_decay": [1e-5, 1e-2], "objective": "val_iou",
                    "direction": "maximize"},
    "resnet18_synthetic": {"task": {"name": "synthetic", "model": "resnet18",
                                    "args": {"shape": [3, 32, 32], "n_train": 4096, "n_val": 512}},
                           "epochs": 2, "batch_size": 128, "optimizer": "sgd", "n_trials": 16, "gpu": True,
                           "lr": [1e-3, 0.3], "weight_decay": [1e-5, 1e-3], "objective": "val_acc",
                           "direction": "maximize"},
}
# --quick: every code path, tiny studies. One worker and the random sampler, which a worker asks
# its whole pack for (a model-based sampler gets a quarter of the budget per ask: no population).
QUICK = {"n_trials": 4, "epochs": 1, "workers": 1, "sampler": "random"}


def _case(ctx: Context, name: str) -> dict:
    case = dict(CASES[name])
    if ctx.quick:
        case.update(QUICK)
        if name == "resnet18_synthetic":  # the same network at 16x16: a quarter of the arithmetic per image
            case["task"] = {**case["task"], "args": {"shape": [3, 16, 16], "n_train": 32, "n_val": 16}}
            case["batch_size"] = 16
    case.update(ctx.options.get("case_overrides", {}).get(name, {}))
    return case


def _spec(name: str, case: dict, pack: int | None, device: str, seed: int) -> dict:
    return tiny_spec(name, task=case["task"],
                     train={"epochs": case["epochs"], "batch_size": case["batch_size"], "optimizer": case["optimizer"],
                            "scheduler": "cosine", "precision": "fp32", "num_workers": 0, "seed": seed,
                            "export_onnx": True, "save_checkpoints": True,
                            "checkpoint_every": case.get("checkpoint_every", 1)},
                     search={"lr": {"type": "float", "low": case["lr"][0], "high": case["lr"][1], "log": True},
                             "weight_decay": {"type": "float", "low": case["weight_decay"][0],
                                              "high": case["weight_decay"][1], "log": True}},
                     objective={"metric": case["objective"], "direction": case["direction"]},
                     sampler={"name": case.get("sampler", "tpe"), "seed": seed}, pruner={"name": "none"},
                     budget={"n_trials": case["n_trials"], "max_failures": 3},
                     resources={"devices": device, "workers": case.get("workers", "auto"),
                                **({"pack": pack} if pack else {})})


class GpuSampler:
    """The GPU's utilisation (%) every half second while an arm runs (``nvidia-smi``); None without one."""

    def __init__(self, on: bool) -> None:
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if on else None
        if self._thread is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.values.append(float(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def mean(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return sum(self.values) / len(self.values) if self.values else None


def _records(folder: Path, experiment: str, metric: str,
             epochs: int) -> tuple[int, int, dict[str, int], list[float]]:
    """The trial runs whose ``metric`` curve has every epoch, those trained in a population, how
    many of those run each way (``layout_of`` their note; "unsaid" for a population stopped
    before its first step), and every trial's objective."""
    from mlflow.tracking import MlflowClient  # lazy for start-up time, as the module's other heavy imports

    from sweeps.trial_population import PACKED_WITH, TAG_PACK, layout_of

    client = MlflowClient(f"sqlite:///{folder}/runs/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return 0, 0, {}, []
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
            if r.data.tags.get("mlflow.parentRunId")]
    whole = [r for r in runs if len(client.get_metric_history(r.info.run_id, metric)) == epochs]
    notes = [r.data.tags.get(TAG_PACK, "") for r in runs]
    packed = [note for note in notes if note.startswith(PACKED_WITH)]
    layouts = Counter(layout_of(note) or "unsaid" for note in packed)
    return (len(whole), len(packed), dict(layouts),
            [r.data.metrics["objective"] for r in runs if "objective" in r.data.metrics])


def _best(values: list[float], maximize: bool) -> float | None:
    return (max(values) if maximize else min(values)) if values else None


def _arm(ctx: Context, case_name: str, case: dict, which: str, device: str, index: int, timeout_s: float) -> dict:
    """One arm's study in round ``index``, seeded with it."""
    folder = ctx.workdir / f"{case_name}-{which}-{index}"
    folder.mkdir(parents=True, exist_ok=True)
    study = f"pk_{case_name}_{which}"
    gpu = GpuSampler(device != "cpu")
    if which == "script":
        cfg = {"name": study, "tracking_uri": f"sqlite:///{folder}/runs/mlflow.db", "out_dir": str(folder / "runs"),
               "task": case["task"], "epochs": case["epochs"], "batch_size": case["batch_size"],
               "optimizer": case["optimizer"], "search": {"lr": case["lr"], "weight_decay": case["weight_decay"]},
               "objective": case["objective"], "direction": case["direction"], "n_trials": case["n_trials"],
               "seed": index, "threads": ctx.options.get("script_threads", 1)}
        (folder / "runs").mkdir(exist_ok=True)
        path = folder / "study.json"
        path.write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.peers.task_script", str(path)], cwd=folder,
                              env=sweeps_env(), capture_output=True, text=True, timeout=timeout_s)
        wall, rc, tail = time.perf_counter() - t0, proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    else:
        spec = _spec(study, case, PACK if which == "packed" else None, device, index)
        res = run_sweeps(folder, write_spec(folder, spec), timeout_s)
        wall, rc, tail = res["wall_s"], res["rc"], res["log_tail"][-1500:]
    utilisation = gpu.mean()
    whole, packed, layouts, values = _records(folder, study, case["objective"], case["epochs"])
    out = {"arm": which, "seed": index, "rc": rc, "wall_s": wall, "trials": case["n_trials"], "records": whole,
           "packed": packed, "layouts": layouts,
           "best": _best(values, case["direction"] == "maximize"), "gpu_util_pct": utilisation,
           "tpm": 60 * case["n_trials"] / wall}
    if rc != 0:
        out["error"] = f"{which} exited {rc}; log tail:\n{tail}"
    return out


def loop_only(ctx: Context, case: dict, members: int) -> dict:
    """The training loop alone, in this process: ``core.train.train_population`` of ``members``
    diabetes MLPs (their own lr and weight decay) against ``core.train.train`` of each one after
    another, no tracking, checkpoints or export; ABAB rounds on 1 torch thread."""
    from core.config import TrainConfig, apply_overrides
    from core.population import MemberRun
    from core.tasks.base import make_task
    from core.train import train, train_population

    threads = ctx.torch_threads(1)
    base = TrainConfig(epochs=case["epochs"], batch_size=case["batch_size"], optimizer=case["optimizer"],
                       scheduler="cosine", precision="fp32", num_workers=0, save_checkpoints=False,
                       monitor=case["objective"], monitor_mode="max" if case["direction"] == "maximize" else "min")
    cfgs = [apply_overrides(base, {"lr": 10 ** (-3 + 2 * k / members), "weight_decay": 10 ** (-4 + k % 4)})
            for k in range(members)]

    def task():
        return make_task(case["task"]["name"], model=case["task"].get("model"), args=case["task"].get("args"))

    def alone() -> float:
        t0 = time.perf_counter()
        for cfg in cfgs:
            train(task(), cfg)
        return time.perf_counter() - t0

    def packed() -> float:
        t0 = time.perf_counter()
        train_population(task(), [MemberRun(cfg) for cfg in cfgs])
        return time.perf_counter() - t0

    values = alternate({"one after another": alone, f"{members} packed": packed}, ctx.n_repeats(3), log=ctx.log)
    ratio = paired_ratio(values["one after another"], values[f"{members} packed"],
                         f"seconds of {members} runs one after another / as one population")
    return make_row(
        f"diabetes_mlp: training loop alone, {members} members", metric="seconds for the runs (in-process)",
        baseline=arm("one after another", values["one after another"]),
        candidate=arm(f"{members} packed", values[f"{members} packed"]), ratio=ratio,
        headline=f"the loop alone: {members} runs {ratio['median']:.2f}x faster packed ({threads} thread)",
        details={"epochs": case["epochs"], "threads": threads})


def run(ctx: Context) -> dict:
    import torch

    on_gpu = torch.cuda.is_available() or bool(ctx.options.get("gpu_case_on_cpu"))
    names = ctx.options.get("cases") or [n for n, c in CASES.items() if not c.get("gpu") or on_gpu]
    device = "auto" if torch.cuda.is_available() else "cpu"
    repeats = ctx.n_repeats(1)
    timeout_s = float(ctx.options.get("timeout_s", ctx.pick(300, 900)))
    rows, details = [], {}
    for case_name in names:
        case = _case(ctx, case_name)
        runs: dict[str, list[dict]] = {"packed": [], "unpacked": [], "script": []}
        for r in range(repeats):
            for which in runs:
                ctx.log(f"{NAME}: {case_name}, {which} ({case['n_trials']} trials, round {r + 1}/{repeats})")
                try:
                    out = _arm(ctx, case_name, case, which, device, r, timeout_s)
                except Exception as exc:  # noqa: BLE001 - a failing arm is reported, the others go on
                    out = {"arm": which, "error": f"{type(exc).__name__}: {exc}"}
                runs[which].append(out)
                ctx.log("  " + (out["error"].splitlines()[0] if "error" in out else
                                f"{out['tpm']:.1f} trials/min, wall {out['wall_s']:.1f} s, {out['records']} whole "
                                f"records, best {case['objective']} {out['best']}"))
        details[case_name] = runs
        rows += _rows(case_name, case, runs)
        ctx.keep(rows)
    if "diabetes_mlp" in names and not ctx.options.get("skip_loop"):
        ctx.log(f"{NAME}: the training loop alone, diabetes MLP, {PACK} members")
        try:
            rows.append(loop_only(ctx, _case(ctx, "diabetes_mlp"), PACK if not ctx.quick else 2))
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            rows.append(error_row("diabetes_mlp: training loop alone", exc))
        ctx.keep(rows)
    diabetes = next((r for r in rows if r["case"].startswith("diabetes_mlp: packed vs script")), None)
    shown = [r["headline"] for r in rows if " vs " not in r["case"] or "script" in r["case"]]
    summary = f"Packed trials: {'; '.join(shown)}" if rows else "Packed trials: no case ran"
    return {"target": f">= {TARGET}x the plain script's trials/min on the 64-trial diabetes study with pack {PACK} "
                      "(CPU, 2 cores), every record kept, best val_rmse as good over the same seeds; no slower than "
                      "unpacked on the digits CNN",
            "summary": summary, "rows": rows, "details": {"runs": details, "gpu_cases": on_gpu},
            "notes": [f"One study per arm, end to end (start-up included); {repeats} round(s). Unpacked and packed "
                      "arms: `sweeps run` with workers: auto, the same spec but resources.pack; the plain script "
                      "runs one trial at a time on 1 torch thread (`--opt script_threads=N`): on 2 cores shared "
                      "with other jobs, 2 threads made it several times slower.",
                      "Records: trial runs whose objective curve has every epoch; best: the best trial's objective "
                      "(its best epoch) in each arm, one per round, each round with its own seed (sampler and "
                      "training); 'behind': packed's best against the other arm's of the same seed, in percent; "
                      "'as good': the packed arm's median over the seeds no worse than the script's.",
                      *([] if on_gpu else ["No GPU here: the ResNet-18 case (GPU utilisation per arm) was not run; "
                                           "tests/benchmarks/test_bench_packed.py runs its code path on CPU."]),
                      *([] if diabetes else ["The diabetes case did not run."])]}


def _bests(case: dict, pairs: list[tuple[dict, dict]]) -> dict:
    """The best objective of each arm per seed (``pairs``: packed and baseline runs of the same
    seeds), their medians, and per seed how far packed is behind (percent of the baseline's best;
    negative: ahead). ``as_good``: every packed run recorded a best and the packed median is no
    worse than the baseline's."""
    maximize = case["direction"] == "maximize"
    seeds = [(p["best"], b["best"]) for p, b in pairs if p["best"] is not None and b["best"] is not None]
    if not seeds:
        return {"packed": [], "base": [], "median": None, "behind_pct": [], "as_good": False}
    sign = -1 if maximize else 1
    behind = [sign * 100 * (p - b) / abs(b) if b else math.nan for p, b in seeds]
    median = {"packed": statistics.median(p for p, _ in seeds), "base": statistics.median(b for _, b in seeds)}
    no_worse = median["packed"] >= median["base"] if maximize else median["packed"] <= median["base"]
    return {"packed": [p for p, _ in seeds], "base": [b for _, b in seeds], "median": median,
            "behind_pct": behind, "as_good": no_worse and all(p["best"] is not None for p, _ in pairs)}


def _rows(case_name: str, case: dict, runs: dict[str, list[dict]]) -> list[dict]:
    ok = {k: [x for x in v if "error" not in x] for k, v in runs.items()}
    rows = []
    for base in ("script", "unpacked"):
        what = f"{case_name}: packed vs {base}"
        if not ok["packed"] or not ok[base]:
            err = next((x["error"] for k in ("packed", base) for x in runs[k] if "error" in x), "no run finished")
            rows.append(error_row(what, err))
            continue
        of_seed = {x.get("seed"): x for x in ok[base]}  # a round that failed in one arm drops out of both
        pairs = [(p, of_seed[p.get("seed")]) for p in ok["packed"] if p.get("seed") in of_seed]
        if not pairs:
            rows.append(error_row(what, "no seed finished in both arms"))
            continue
        ratio = paired_ratio([p["tpm"] for p, _ in pairs], [b["tpm"] for _, b in pairs],
                             f"trials/min packed (pack {PACK}) / {base}")
        best = _bests(case, pairs)
        target, verdict = None, None
        if case_name == "diabetes_mlp" and base == "script":
            target = f">= {TARGET}x, every record, best as good"
            verdict = (ratio["median"] >= TARGET and all(p["records"] == p["trials"] for p in ok["packed"])
                       and best["as_good"])
        if case_name == "digits_cnn" and base == "unpacked":
            target, verdict = ">= 1x", ratio["median"] >= 1.0
        util = {k: ok[k][0].get("gpu_util_pct") for k in ("packed", base)}
        behind = [d for d in best["behind_pct"] if not math.isnan(d)]  # NaN: a baseline best of 0
        shown = (f"best {case['objective']} {best['median']['packed']:.4g} vs {best['median']['base']:.4g} (medians "
                 f"of {len(best['packed'])} seed(s))" if best["median"] else
                 f"best {case['objective']}: an arm recorded none")
        if behind:
            shown += (f"; packed behind on {sum(d > 0 for d in behind)} of {len(behind)}, by "
                      f"{statistics.median(behind):+.2f}% (median; {min(behind):+.2f}% to {max(behind):+.2f}%)")
        rows.append(make_row(
            what, metric="trials per minute (end to end)",
            baseline=arm(f"{base}", [b["tpm"] for _, b in pairs]),
            candidate=arm(f"pack {PACK}", [p["tpm"] for p, _ in pairs]), ratio=ratio, target=target,
            meets_target=verdict,
            headline=(f"{case_name}: {ratio['median']:.2f}x the {base} arm's trials/min; records "
                      f"{pairs[0][0]['records']}/{pairs[0][0]['trials']} vs {pairs[0][1]['records']}; {shown}"
                      + (f"; GPU util {util['packed']:.0f}% vs {util[base]:.0f}%"
                         if util["packed"] is not None and util[base] is not None else "")),
            details={"best": best, "gpu_util_pct": util}))
    return rows
