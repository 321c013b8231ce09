"""Search efficiency: ``studies/lr_bs.yaml`` with its median pruner against the same study without
pruning (``pruner: none``), over several sampler seeds.

For each seed both studies run through ``sweeps run`` on a copy of the spec in a temp folder
(only the name, ``sampler.seed``, the pruner and ``export_onnx: false`` change; ONNX export
does not touch training). Per study: the best validation accuracy (best COMPLETE trial, as
``sweeps status`` reports it) and the epochs trained (sum over trials of the epochs each ran,
from Optuna's intermediate values). Target: the pruned study reaches the same best accuracy
within 0.5 points with at most half the epochs.

The pruned and unpruned study of one seed run at the same time, each pinned to its own CPU
(so each gets one worker with one thread): the results do not depend on speed.
"""
from __future__ import annotations

import copy
import os
import statistics
import time

import yaml

from benchmarks.common import ROOT, Context, arm, bench_main, error_row, make_row, stats
from benchmarks.sweeps_runs import optuna_study, start_sweeps, wait_sweeps, write_spec

NAME = "search_efficiency"
TITLE = "Search efficiency: lr_bs with median pruning vs without, over sampler seeds"
SPEC = ROOT / "studies" / "lr_bs.yaml"
ACC_TOL = 0.005
EPOCH_FRACTION = 0.5


def variant(base: dict, seed: int, pruned: bool, quick: bool) -> dict:
    spec = copy.deepcopy(base)
    spec["name"] = f"lr_bs_seed{seed}_{'median' if pruned else 'nopruner'}"
    spec["sampler"] = {**spec.get("sampler", {}), "seed": seed}
    if not pruned:
        spec["pruner"] = {"name": "none"}
    spec["train"] = {**spec.get("train", {}), "export_onnx": False}
    spec.pop("storage", None)  # the default journal in the temp folder's runs/
    spec["tracking"] = {"uri": "sqlite:///runs/mlflow.db"}
    spec["resources"] = {**spec.get("resources", {}), "devices": "cpu"}
    if quick:
        spec["train"]["epochs"] = 3
        spec["budget"] = {**spec["budget"], "n_trials": 3}
        if pruned:
            spec["pruner"] = {**spec["pruner"], "warmup_epochs": 1}
    return spec


def summarise(folder, spec: dict, res: dict) -> dict:
    out = {"name": spec["name"], "rc": res["rc"], "wall_s": res["wall_s"]}
    if res["rc"] != 0:
        out["error"] = f"sweeps run exited {res['rc']}; log tail:\n{res['log_tail'][-1200:]}"
        return out
    study = optuna_study(folder, spec["name"])
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None]
    epochs = sum(len(t.intermediate_values) for t in trials)
    out.update(
        best_val_acc=max(t.value for t in complete) if complete else float("nan"),
        epochs_trained=epochs, epochs_full=len(trials) * spec["train"]["epochs"],
        counts={s: sum(1 for t in trials if t.state.name == s) for s in ("COMPLETE", "PRUNED", "FAIL")},
        best_params=max(complete, key=lambda t: t.value).params if complete else None,
    )
    return out


def run(ctx: Context) -> dict:
    base = yaml.safe_load(SPEC.read_text())
    seeds = list(ctx.options.get("seeds", ctx.pick([0], [0, 1, 2])))
    cpus = sorted(os.sched_getaffinity(0))
    concurrent = len(cpus) >= 2
    timeout_s = ctx.pick(300, 540)
    per_seed: dict[int, dict] = {}
    last = 0.0
    for seed in seeds:
        if per_seed and not ctx.can_afford(1.1 * last, f"seed {seed}"):
            continue
        t_seed = time.monotonic()
        specs = {pruned: variant(base, seed, pruned, ctx.quick) for pruned in (True, False)}
        folders = {pruned: ctx.workdir / specs[pruned]["name"] for pruned in specs}
        ctx.log(f"{NAME}: seed {seed}: {specs[True]['budget']['n_trials']} trials x "
                f"{specs[True]['train']['epochs']} epochs, pruned and unpruned "
                f"{'side by side, one CPU each' if concurrent else 'one after the other'}")
        results = {}
        if concurrent:
            handles = {p: start_sweeps(folders[p], write_spec(folders[p], specs[p]), cpus=[cpus[i]])
                       for i, p in enumerate((True, False))}
            for p, h in handles.items():
                results[p] = summarise(folders[p], specs[p], wait_sweeps(h, timeout_s))
        else:
            for p in (True, False):
                h = start_sweeps(folders[p], write_spec(folders[p], specs[p]))
                results[p] = summarise(folders[p], specs[p], wait_sweeps(h, timeout_s))
        per_seed[seed] = {"pruned": results[True], "unpruned": results[False]}
        last = time.monotonic() - t_seed
        for label, r in per_seed[seed].items():
            ctx.log(f"  {label}: " + (r["error"].splitlines()[0] if "error" in r else
                                      f"best val_acc {r['best_val_acc']:.4f}, {r['epochs_trained']} epochs, "
                                      f"{r['counts']}, {r['wall_s']:.0f} s"))

    rows = []
    good = {s: v for s, v in per_seed.items() if "error" not in v["pruned"] and "error" not in v["unpruned"]}
    for seed, v in per_seed.items():
        p, u = v["pruned"], v["unpruned"]
        if seed not in good:
            rows.append(error_row(f"seed {seed}", p.get("error") or u.get("error"), details=v))
            continue
        gap = u["best_val_acc"] - p["best_val_acc"]
        frac = p["epochs_trained"] / u["epochs_trained"]
        rows.append(make_row(
            f"seed {seed}", metric="epochs trained (sum over trials)",
            baseline=arm("pruner: none", [u["epochs_trained"]]), candidate=arm("median pruner", [p["epochs_trained"]]),
            ratio={**stats([frac]), "definition": "epochs with pruning / epochs without"},
            target=f"epochs ratio <= {EPOCH_FRACTION}, accuracy gap <= {100 * ACC_TOL:.1f} points",
            meets_target=frac <= EPOCH_FRACTION and gap <= ACC_TOL,
            headline=f"best val_acc {100 * p['best_val_acc']:.2f}% pruned vs {100 * u['best_val_acc']:.2f}% "
                     f"unpruned (gap {100 * gap:+.2f} points); epochs {p['epochs_trained']} vs {u['epochs_trained']}",
            details=v))
    if not good:
        first_error = next((r["error"] for r in rows if r.get("error")), "no seeds ran")
        summary = f"Search efficiency: failed ({first_error.splitlines()[0][:120]})"
    else:
        gaps = [v["unpruned"]["best_val_acc"] - v["pruned"]["best_val_acc"] for v in good.values()]
        ep_p = sum(v["pruned"]["epochs_trained"] for v in good.values())
        ep_u = sum(v["unpruned"]["epochs_trained"] for v in good.values())
        frac = ep_p / ep_u
        gap_med = statistics.median(gaps)
        rows.insert(0, make_row(
            f"all seeds ({len(good)})", metric="epochs trained (sum over trials and seeds)",
            baseline=arm("pruner: none, epochs per seed", [v["unpruned"]["epochs_trained"] for v in good.values()]),
            candidate=arm("median pruner, epochs per seed", [v["pruned"]["epochs_trained"] for v in good.values()]),
            ratio={**stats([v["pruned"]["epochs_trained"] / v["unpruned"]["epochs_trained"] for v in good.values()]),
                   "definition": "epochs with pruning / epochs without (per seed)"},
            target=f"epochs ratio <= {EPOCH_FRACTION}, accuracy gap <= {100 * ACC_TOL:.1f} points",
            meets_target=frac <= EPOCH_FRACTION and gap_med <= ACC_TOL,
            headline=f"{frac:.2f}x the epochs ({ep_p} vs {ep_u}); best val_acc gap median {100 * gap_med:+.2f} "
                     f"points (per seed {', '.join(f'{100 * g:+.2f}' for g in gaps)})",
            details={"epochs_ratio_total": frac, "accuracy_gaps": gaps}))
        summary = (f"Search efficiency (lr_bs, median pruner vs none, {len(good)} seeds): {frac:.2f}x the epochs, "
                   f"best val_acc gap {100 * gap_med:+.2f} points (target <= {EPOCH_FRACTION}x, "
                   f"<= {100 * ACC_TOL:.1f} points)")
    return {
        "target": f"same best val_acc within {100 * ACC_TOL:.1f} points using <= {EPOCH_FRACTION:.0%} of the epochs",
        "summary": summary, "rows": rows,
        "notes": [f"Spec: {SPEC.relative_to(ROOT)} ({base['budget']['n_trials']} trials x {base['train']['epochs']} "
                  f"epochs; pruner {base['pruner']}), copied with name, sampler.seed, pruner and "
                  "export_onnx: false changed." + (" Quick mode: 3 trials x 3 epochs." if ctx.quick else ""),
                  "Accuracy gap = best val_acc without pruning - with pruning (positive: pruning lost accuracy)."],
        "details": {"per_seed": per_seed},
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(NAME, TITLE, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
