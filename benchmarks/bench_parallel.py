"""Parallel efficiency: trials per minute with 2 CPU workers against 1 worker (Optuna backend).

The same study run by ``sweeps run`` with ``resources.workers: 1`` and ``workers: 2``: trials of
``studies/lr_bs.yaml`` (its ``train`` section: the digits CNN with OneCycle, clipping,
checkpoints and a verified ONNX export) at a fixed batch size of 32, searching only the
learning rate, so every trial costs the same.
The pool gives 1 worker all the CPU threads and 2 workers half each, as ``sweeps`` does.
Rounds alternate 1 worker, 2 workers (ABAB); the ratio is taken inside each round.

Trials per minute, two ways:
* steady state (judged): finished trials / (last trial end - first trial start);
* end to end: finished trials / wall time of ``sweeps run`` (start-up included, which does not
  parallelise).
"""
from __future__ import annotations

import statistics
import time

import yaml

from benchmarks.common import ROOT, Context, arm, error_row, make_row, paired_ratio, stats
from benchmarks.sweeps_runs import mlflow_trials, run_sweeps, tiny_spec, write_spec

NAME = "parallel"
TITLE = "Parallel efficiency: trials/min with 2 CPU workers vs 1 (sweeps run, Optuna)"
TARGET = 1.7


def one_study(ctx: Context, main_study: dict, workers: int, n_trials: int, index: int, timeout_s: float) -> dict:
    """``main_study``: studies/lr_bs.yaml, whose task, train section and lr range the trials take."""
    name = f"par_w{workers}"
    folder = ctx.workdir / f"{name}-{index}"
    spec = tiny_spec(name, task=main_study["task"],
                     train={**main_study["train"], "epochs": ctx.pick(1, main_study["train"]["epochs"]),
                            "batch_size": 32},
                     search={"lr": main_study["search"]["lr"]},
                     budget={"n_trials": n_trials, "max_failures": 3},
                     resources={"devices": "cpu", "workers": workers})
    res = run_sweeps(folder, write_spec(folder, spec), timeout_s)
    trials = mlflow_trials(folder, name)
    done = [t for t in trials if t["state"] in ("COMPLETE", "PRUNED")]
    out = {"workers": workers, "rc": res["rc"], "wall_s": res["wall_s"], "n_trials": len(done)}
    if res["rc"] != 0 or len(done) < n_trials:
        out["error"] = (f"sweeps run (workers {workers}) exited {res['rc']} with {len(done)}/{n_trials} finished "
                        f"trials; log tail:\n{res['log_tail'][-1200:]}")
        return out
    window = max(t["end_s"] for t in done) - min(t["start_s"] for t in done)
    out.update(steady_tpm=60 * len(done) / window, e2e_tpm=60 * len(done) / res["wall_s"], window_s=window,
               trial_seconds=stats(t["trial_seconds"] for t in done if t["trial_seconds"] is not None),
               workers_seen=len({t.get("worker") for t in done}))
    return out


def run(ctx: Context) -> dict:
    # 8 trials a study: two rounds (1 worker, then 2) fit the suite's budget; one round alone
    # is at the mercy of the VM's drift, which moves the ratio's ceiling from 1.3x to 2.3x.
    n_trials = int(ctx.options.get("n_trials", ctx.pick(2, 8)))
    repeats = ctx.n_repeats(3)
    timeout_s = ctx.pick(240, 360)
    main_study = yaml.safe_load((ROOT / "studies" / "lr_bs.yaml").read_text())
    runs: dict[int, list[dict]] = {1: [], 2: []}
    last = 0.0
    for r in range(repeats):
        if r and not ctx.can_afford(1.1 * last, f"round {r + 1} of {repeats}"):
            break
        t_round = time.monotonic()
        for workers in (1, 2):
            ctx.log(f"{NAME}: {n_trials} trials with {workers} worker(s) (round {r + 1}/{repeats})")
            try:
                out = one_study(ctx, main_study, workers, n_trials, r, timeout_s)
            except Exception as exc:  # noqa: BLE001
                out = {"workers": workers, "error": f"{type(exc).__name__}: {exc}"}
            runs[workers].append(out)
            ctx.log("  " + (out["error"].splitlines()[0] if "error" in out else
                            f"steady {out['steady_tpm']:.1f} trials/min, end to end {out['e2e_tpm']:.1f}, "
                            f"wall {out['wall_s']:.1f} s"))
        last = time.monotonic() - t_round
    pairs = [(a, b) for a, b in zip(runs[1], runs[2], strict=True) if "error" not in a and "error" not in b]
    if not pairs:
        err = next((r["error"] for w in (1, 2) for r in runs[w] if "error" in r), "no run finished")
        rows = [error_row("2 workers vs 1", err, target=f">= {TARGET}x", details={"runs": runs})]
        summary = f"Parallel efficiency: failed ({err.splitlines()[0][:120]})"
    else:
        one, two = [p[0] for p in pairs], [p[1] for p in pairs]
        steady = paired_ratio([b["steady_tpm"] for b in two], [a["steady_tpm"] for a in one],
                              "trials/min with 2 workers / with 1 (steady state, per round)")
        e2e = paired_ratio([b["e2e_tpm"] for b in two], [a["e2e_tpm"] for a in one],
                           "trials/min with 2 workers / with 1 (end to end, per round)")
        t1 = statistics.median(a["trial_seconds"]["median"] for a in one)
        t2 = statistics.median(b["trial_seconds"]["median"] for b in two)
        # A 1-worker trial has 2 threads, a 2-worker trial 1: it can only be slower when the two
        # threads fought other processes for the cores (a torch op then waits for a descheduled thread).
        contended = t1 > 1.25 * t2
        verdict = None if contended else steady["median"] >= TARGET
        # What 2 workers could give at best here: each trial runs t2 on one thread instead of t1
        # on two, so 2 at once finish 2 * t1 / t2 as many per minute, with nothing between trials.
        ceiling = 2 * t1 / t2
        rows = [make_row(
            "2 workers vs 1", metric="trials per minute (steady state)",
            baseline=arm("1 worker (2 threads)", [a["steady_tpm"] for a in one]),
            candidate=arm("2 workers (1 thread each)", [b["steady_tpm"] for b in two]),
            ratio=steady, target=f">= {TARGET}x", meets_target=verdict,
            headline=(f"NOT VALID on this run: {steady['median']:.2f}x, because the 1-worker trials (2 threads) took "
                      f"{t1:.2f} s against {t2:.2f} s for 2-worker trials (1 thread): other processes held the cores"
                      if contended else
                      f"{steady['median']:.2f}x trials/min (end to end, start-up included: {e2e['median']:.2f}x); "
                      f"ceiling from the trials' own times {ceiling:.2f}x (2 x {t1:.2f} s on 2 threads / "
                      f"{t2:.2f} s on 1)"),
            details={"end_to_end_ratio": e2e, "runs": runs, "contended": contended,
                     "trial_seconds_median": {"1 worker": t1, "2 workers": t2}, "ceiling": ceiling})]
        summary = (f"Parallel efficiency (trials/min, 2 CPU workers vs 1, {n_trials} lr_bs trials at batch 32): "
                   f"{steady['median']:.2f}x steady state, {e2e['median']:.2f}x end to end (target >= {TARGET}x)"
                   + (f"; NOT VALID: 1-worker trials (2 threads) were slower than 2-worker trials (1 thread), "
                      f"{t1:.1f} s vs {t2:.1f} s: the machine was busy" if contended else ""))
    return {
        "target": f">= {TARGET}x trials per minute with 2 workers on this machine",
        "summary": summary, "rows": rows,
        "notes": [f"Trials: studies/lr_bs.yaml's train section (digits CNN, OneCycle, grad clip 1.0, checkpoints, "
                  f"ONNX export verified in onnxruntime), batch 32, {ctx.pick(1, main_study['train']['epochs'])} "
                  "epoch(s); random sampler over "
                  "lr only (equal cost per trial), no pruner.",
                  "Each worker gets cpu_threads // workers torch threads (sweeps.slot_plan.plan_workers). The ceiling "
                  "is 2 x (1-worker trial time) / (2-worker trial time): a trial that gains from its second "
                  "thread leaves less for a second worker to add."],
        "details": {"runs": runs},
    }

