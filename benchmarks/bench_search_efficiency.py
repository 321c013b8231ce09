"""Search efficiency: ``studies/lr_bs.yaml`` with its own pruner against the same study without
pruning (``pruner: none``), over several sampler seeds; other pruners are run beside them for
comparison (not judged).

For each seed every arm runs through ``sweeps run`` on a copy of the spec in a temp folder
(only the name, ``sampler.seed``, the pruner and ``export_onnx: false`` change; ONNX export
does not touch training). Per study: the best validation accuracy (best COMPLETE trial, as
``sweeps status`` reports it) and the epochs trained (sum over trials of the epochs each ran,
from Optuna's intermediate values). Target: the pruned study reaches the same best accuracy
within 0.5 points with at most half the epochs.

The studies run two at a time, each pinned to its own CPU (one worker with one thread): the
results do not depend on speed, and a rerun of the same code gives the same figures.

Options (``--opt KEY=JSON``): ``seeds`` (default ``[0, 1, 2]``) and ``compare``, the pruner
sections run beside the spec's own (default: the median pruner with a 2-epoch warm-up, the
study's pruner until its choice was measured on seeds 3-12; see benchmarks/README.md).
"""
from __future__ import annotations

import copy
import os
import statistics
import time

import yaml

from benchmarks.common import ROOT, Context, arm, error_row, make_row, stats
from benchmarks.sweeps_runs import optuna_study, start_sweeps, wait_sweeps, write_spec

NAME = "search_efficiency"
TITLE = "Search efficiency: lr_bs with its pruner vs without, over sampler seeds"
SPEC = ROOT / "studies" / "lr_bs.yaml"
ACC_TOL = 0.005
EPOCH_FRACTION = 0.5
COMPARE = [{"name": "median", "warmup_epochs": 2}]
TARGET = f"epochs ratio <= {EPOCH_FRACTION}, accuracy gap <= {100 * ACC_TOL:.1f} points"
OWN, NONE = "own", "none"  # arm keys: the spec's pruner, no pruning; compared ones are "compare<i>"


def pruner_label(pruner: dict) -> str:
    """``asha (min_resource 1, reduction_factor 3)``: the section as a reader would write it."""
    opts = ", ".join(f"{k} {v}" for k, v in pruner.items() if k != "name")
    return f"{pruner['name']} ({opts})" if opts else pruner["name"]


def variant(base: dict, seed: int, key: str, pruner: dict, quick: bool) -> dict:
    spec = copy.deepcopy(base)
    spec["name"] = f"lr_bs_seed{seed}_{key}"
    spec["sampler"] = {**spec.get("sampler", {}), "seed": seed}
    spec["pruner"] = dict(pruner)
    spec["train"] = {**spec.get("train", {}), "export_onnx": False}
    spec.pop("storage", None)  # the default journal in the temp folder's runs/
    spec["tracking"] = {"uri": "sqlite:///runs/mlflow.db"}
    spec["resources"] = {**spec.get("resources", {}), "devices": "cpu"}
    if quick:
        spec["train"]["epochs"] = 3
        spec["budget"] = {**spec["budget"], "n_trials": 3}
        if "warmup_epochs" in pruner:
            spec["pruner"]["warmup_epochs"] = 1
    return spec


def summarise(folder, spec: dict, res: dict) -> dict:
    out = {"name": spec["name"], "pruner": spec["pruner"], "rc": res["rc"], "wall_s": res["wall_s"]}
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


def run_studies(ctx: Context, jobs: list[tuple[int, str, dict]], timeout_s: float) -> dict[int, dict[str, dict]]:
    """Run ``(seed, key, spec)`` jobs in order, one per CPU at a time; ``{seed: {key: summary}}``.
    A job the time budget cannot fit (estimated from the slowest finished one) is left out."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    results: dict[int, dict[str, dict]] = {}
    running: dict[int, tuple] = {}
    slowest = 0.0
    while jobs or running:
        while jobs and len(running) < len(cpus):
            seed, key, spec = jobs.pop(0)
            if slowest and not ctx.can_afford(slowest / len(cpus), f"seed {seed} {pruner_label(spec['pruner'])}"):
                continue
            cpu = next(c for c in cpus if c not in running)
            folder = ctx.workdir / spec["name"]
            running[cpu] = (seed, key, spec, folder, start_sweeps(folder, write_spec(folder, spec), cpus=[cpu]))
        time.sleep(0.2)
        for cpu, (seed, key, spec, folder, handle) in list(running.items()):
            if handle["proc"].poll() is None and time.perf_counter() - handle["t0"] < timeout_s:
                continue
            r = summarise(folder, spec, wait_sweeps(handle, 1))
            results.setdefault(seed, {})[key] = r
            slowest = max(slowest, r["wall_s"])
            del running[cpu]
            ctx.log(f"  seed {seed}, {pruner_label(spec['pruner'])}: " + (
                r["error"].splitlines()[0] if "error" in r else
                f"best val_acc {r['best_val_acc']:.4f}, {r['epochs_trained']} epochs, {r['counts']}, "
                f"{r['wall_s']:.0f} s"))
    return results


def arm_row(case: str, label: str, seeds: dict[int, dict[str, dict]], key: str, judged: bool) -> dict:
    """One pruner over every seed where both it and the unpruned study ran (``{n}`` in ``case``
    becomes their number); one seed's row is the same over a single seed."""
    missing = {"error": "did not run"}
    good = {s: v for s, v in seeds.items()
            if "error" not in v.get(key, missing) and "error" not in v.get(NONE, missing)}
    gaps = [v[NONE]["best_val_acc"] - v[key]["best_val_acc"] for v in good.values()]
    ep_p = sum(v[key]["epochs_trained"] for v in good.values())
    ep_u = sum(v[NONE]["epochs_trained"] for v in good.values())
    frac, gap_med = ep_p / ep_u, statistics.median(gaps)
    best_p = statistics.median(v[key]["best_val_acc"] for v in good.values())
    best_u = statistics.median(v[NONE]["best_val_acc"] for v in good.values())
    return make_row(
        case.format(n=len(good)), metric="epochs trained (sum over trials and seeds)",
        baseline=arm("pruner: none, epochs per seed", [v[NONE]["epochs_trained"] for v in good.values()]),
        candidate=arm(f"{label}, epochs per seed", [v[key]["epochs_trained"] for v in good.values()]),
        ratio={**stats([v[key]["epochs_trained"] / v[NONE]["epochs_trained"] for v in good.values()]),
               "definition": "epochs with pruning / epochs without (per seed)"},
        target=TARGET if judged else None,
        meets_target=(frac <= EPOCH_FRACTION and gap_med <= ACC_TOL) if judged else None,
        headline=f"{label}: {frac:.2f}x the epochs ({ep_p} vs {ep_u}); best val_acc {100 * best_p:.2f}% vs "
                 f"{100 * best_u:.2f}% unpruned (median), gap median {100 * gap_med:+.2f} points "
                 f"(per seed {', '.join(f'{100 * g:+.2f}' for g in gaps)})",
        details={"epochs_ratio_total": frac, "accuracy_gaps": gaps, "seeds": sorted(good),
                 **({"studies": next(iter(good.values()))} if len(good) == 1 else {})})


def run(ctx: Context) -> dict:
    base = yaml.safe_load(SPEC.read_text())
    seeds = list(ctx.options.get("seeds", ctx.pick([0], [0, 1, 2])))
    compare = list(ctx.options.get("compare", ctx.pick([], COMPARE)))
    arms = {OWN: base["pruner"], NONE: {"name": "none"}, **{f"compare{i}": p for i, p in enumerate(compare)}}
    compared = [k for k in arms if k not in (OWN, NONE)]
    # The judged pair of every seed first; the compared pruners after, as the budget allows.
    jobs = [(s, k, variant(base, s, k, arms[k], ctx.quick)) for s in seeds for k in (OWN, NONE)]
    jobs += [(s, k, variant(base, s, k, arms[k], ctx.quick)) for k in compared for s in seeds]
    labels = {k: pruner_label(spec["pruner"]) for _, k, spec in jobs}  # as run (quick mode shortens warm-ups)
    own_label = labels[OWN]
    ctx.log(f"{NAME}: seeds {seeds}: {jobs[0][2]['budget']['n_trials']} trials x {jobs[0][2]['train']['epochs']} "
            f"epochs; pruners: {', '.join(labels.values())}; two studies at a time")
    per_seed = run_studies(ctx, jobs, timeout_s=ctx.pick(300, 540))

    judged = {s: v for s, v in per_seed.items() if OWN in v and NONE in v}
    errors = [error_row(f"seed {s}", v[OWN].get("error") or v[NONE].get("error"), details=v)
              for s, v in judged.items() if "error" in v[OWN] or "error" in v[NONE]]
    if len(errors) == len(judged):
        first_error = errors[0]["error"] if errors else "no seeds ran"
        summary = f"Search efficiency: failed ({first_error.splitlines()[0][:120]})"
        rows = errors
    else:
        head = arm_row("all seeds ({n})", own_label, per_seed, OWN, judged=True)
        shown = [k for k in compared if any(k in v for v in per_seed.values())]
        others = [arm_row("compared, all seeds ({n})", labels[k], per_seed, k, judged=False) for k in shown]
        per_seed_rows = [arm_row(f"seed {s}", own_label, {s: v}, OWN, judged=True)
                         for s, v in judged.items() if "error" not in v[OWN] and "error" not in v[NONE]]
        rows = [head, *others, *per_seed_rows, *errors]
        summary = (f"Search efficiency (lr_bs, {own_label} vs none, {len(head['details']['seeds'])} seeds): "
                   f"{head['details']['epochs_ratio_total']:.2f}x the epochs, best val_acc gap "
                   f"{100 * statistics.median(head['details']['accuracy_gaps']):+.2f} points "
                   f"(target <= {EPOCH_FRACTION}x, <= {100 * ACC_TOL:.1f} points)")
        summary += "".join(f"; {labels[k]}: {r['details']['epochs_ratio_total']:.2f}x, gap "
                           f"{100 * statistics.median(r['details']['accuracy_gaps']):+.2f}"
                           for k, r in zip(shown, others, strict=True))
    return {
        "target": f"same best val_acc within {100 * ACC_TOL:.1f} points using <= {EPOCH_FRACTION:.0%} of the epochs",
        "summary": summary, "rows": rows,
        "notes": [f"Spec: {SPEC.relative_to(ROOT)} ({base['budget']['n_trials']} trials x {base['train']['epochs']} "
                  f"epochs; pruner {own_label}), copied with name, sampler.seed, pruner and "
                  "export_onnx: false changed." + (" Quick mode: 3 trials x 3 epochs." if ctx.quick else ""),
                  "Accuracy gap = best val_acc without pruning - with pruning (positive: pruning lost accuracy). "
                  "One validation image is 0.28 points.",
                  "Rows 'compared' are other pruners on the same seeds, for reference; only the spec's pruner "
                  "is judged."],
        "details": {"per_seed": per_seed, "pruners": arms},
    }

