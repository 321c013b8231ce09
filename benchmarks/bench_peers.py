"""End to end against the peers: the same study run by ``sweeps run`` and by the scripts a user
would write instead (``benchmarks/peers/``), whole-study wall time and trials per minute.

Arms, each a fresh process in a fresh folder with its own SQLite MLflow store:

* ``sweeps run`` (the real CLI, the spec's ``workers: auto``);
* plain Optuna + ``MlflowClient`` (``optuna_mlflow_script.py``) with ``n_jobs`` 1 and 2;
* Optuna with optuna-integration's ``MLflowCallback`` (``optuna_mlflow_callback.py``);
* Ray Tune with ``setup_mlflow`` (``ray_tune_mlflow.py``).

Studies: ``studies/lr_bs.yaml`` as shipped, the same with ``pruner: none``, and a bigger digits
CNN without pruning (``width`` 96, 8 epochs, 4 trials: about 10 s a trial on one core; a wider
model of 8x8 images costs little more, its time goes to per-step work). Each round runs every arm once, the order
reversed every other round (ABCDE, EDCBA) so drift hits all; the judged ratio is sweeps' trials
per minute over the best peer's in the same round. After each run the arm's MLflow store is read
back (``peers/records.py``): what it recorded is reported from the store, not assumed. Time to
the first trial step is the same clock for every arm (``peers/step_clock``): from the arm's launch
to the end of the first optimizer step any of its processes takes. The
breakdown of a ``sweeps run`` trial's time (``peers/breakdown.py``) comes from the no-pruning
study's trial runs and from the pieces timed alone in a fresh process.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.common import ROOT, Context, arm, error_row, make_row, paired_ratio, stats
from benchmarks.peers import breakdown
from benchmarks.peers.records import recorded, table
from benchmarks.peers.step_clock.sitecustomize import ENV_FIRST_STEP
from benchmarks.sweeps_runs import run_sweeps, sweeps_env

NAME = "peers"
TITLE = "End to end against the peers: sweeps run vs hand-written Optuna/Ray + MLflow scripts"
TARGETS = {"lr_bs": 1.0, "lr_bs_nopruning": 1.2, "big_cnn": 1.0}  # sweeps / best peer, trials per minute
PEERS = {  # arm -> (module under benchmarks.peers, extra arguments)
    "script n_jobs=1": ("optuna_mlflow_script", ["--n-jobs", "1"]),
    "script n_jobs=2": ("optuna_mlflow_script", ["--n-jobs", "2"]),
    "optuna MLflowCallback": ("optuna_mlflow_callback", []),
    "ray tune + setup_mlflow": ("ray_tune_mlflow", []),
}
ARMS = ("sweeps run", *PEERS)
STEP_CLOCK = Path(__file__).parent / "peers" / "step_clock"  # its sitecustomize, first on every arm's path


def studies(ctx: Context) -> dict[str, dict]:
    """The three sweeps specs, from studies/lr_bs.yaml (smaller with --quick or ``--opt study=``)."""
    shipped = yaml.safe_load((ROOT / "studies" / "lr_bs.yaml").read_text())
    out = {}
    n, epochs = shipped["budget"]["n_trials"], shipped["train"]["epochs"]
    for name, pruner, width, trials, full_epochs in (("lr_bs", shipped["pruner"], 16, n, epochs),
                                                     ("lr_bs_nopruning", {"name": "none"}, 16, n, epochs),
                                                     ("big_cnn", {"name": "none"}, 96, 4, 8)):
        spec = copy.deepcopy(shipped)
        spec.update(name=name, pruner=pruner, storage=f"runs/{name}.journal")
        spec["tracking"] = {"uri": "sqlite:///runs/mlflow.db"}
        spec["task"]["args"]["width"] = ctx.pick(min(width, 24), width)
        spec["budget"]["n_trials"] = ctx.pick(3 if name != "big_cnn" else 2, trials)
        spec["train"]["epochs"] = ctx.pick(2 if name != "big_cnn" else 1, full_epochs)
        for key, value in ctx.options.get("study", {}).items():  # tests: e.g. {"n_trials": 2, "epochs": 1}
            (spec["budget"] if key == "n_trials" else spec["train"])[key] = value
        out[name] = spec
    wanted = ctx.options.get("studies")
    return {k: v for k, v in out.items() if not wanted or k in wanted}


def peer_study(spec: dict, folder: Path) -> dict:
    """What a peer script reads: the spec's study in plain numbers (benchmarks/peers/digits_cnn.py)."""
    train, search = spec["train"], spec["search"]
    return {"name": spec["name"], "epochs": train["epochs"], "width": spec["task"]["args"]["width"],
            "n_trials": spec["budget"]["n_trials"],
            "lr": {"low": search["lr"]["low"], "high": search["lr"]["high"]},
            "batch_sizes": search["batch_size"]["choices"],
            "pruner": {"name": spec["pruner"]["name"], "warmup_epochs": spec["pruner"].get("warmup_epochs", 0)},
            "sampler": spec["sampler"]["name"], "seed": spec["sampler"]["seed"],
            "n_startup_trials": spec["sampler"]["n_startup_trials"],
            "momentum": train["momentum"], "weight_decay": train["weight_decay"], "grad_clip": train["grad_clip"],
            "val_fraction": spec["task"]["args"]["val_fraction"],
            "tracking_uri": f"sqlite:///{folder / 'mlflow.db'}", "out_dir": str(folder)}


def run_arm(arm_name: str, spec: dict, folder: Path, timeout_s: float, source: Path | None = None) -> dict:
    """One study by one arm: wall time, and what its store holds afterwards. ``source``: the
    ``sweeps run`` arm imports sweeps and core from that source tree instead (another commit's)."""
    folder.mkdir(parents=True)
    env = step_clock_env(folder / "first_step")
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(STEP_CLOCK), str(source), env["PYTHONPATH"].split(os.pathsep, 1)[1]])
    launched = time.time()  # the MLflow store's clock: its runs' start times are wall-clock milliseconds
    if arm_name == "sweeps run":
        spec_path = folder / f"{spec['name']}.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        res = run_sweeps(folder, spec_path, timeout_s, env=env)
        rc, wall, tail, uri = res["rc"], res["wall_s"], res["log_tail"], f"sqlite:///{folder}/runs/mlflow.db"
    else:
        module, extra = PEERS[arm_name]
        study_file = folder / "study.json"
        study_file.write_text(json.dumps(peer_study(spec, folder)))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", f"benchmarks.peers.{module}", str(study_file), *extra],
                                  cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = -9, f"timed out after {timeout_s:.0f} s: {str(exc.stderr or '')[-2000:]}"
        wall, uri = time.perf_counter() - t0, f"sqlite:///{folder / 'mlflow.db'}"
    rec = recorded(uri, spec["name"])
    n = spec["budget"]["n_trials"]
    finished = sum(v for k, v in rec.get("statuses", {}).items() if k in ("FINISHED", "KILLED"))
    out = {"rc": rc, "wall_s": wall, "trials": finished, "tpm": 60 * finished / wall, "records": rec,
           "tracking_uri": uri, **first_trial_seconds(rec, launched),
           "first_step_s": first_step_seconds(folder / "first_step", launched)}
    if rc != 0 or finished < n or rec["trial_runs"] > n:
        out["error"] = (f"{arm_name} exited {rc} with {finished} finished of {rec['trial_runs']} trial runs for {n} "
                        f"trials; log tail:\n{tail[-1500:]}")
    return out


def step_clock_env(stamp: Path) -> dict:
    """An arm's environment with the step clock on: its first optimizer step writes ``stamp``."""
    env = sweeps_env(**{ENV_FIRST_STEP: str(stamp)})
    env["PYTHONPATH"] = str(STEP_CLOCK) + os.pathsep + env["PYTHONPATH"]
    return env


def first_step_seconds(stamp: Path, launched: float) -> float | None:
    """Seconds from the arm's launch to the end of its first optimizer step (the step clock's file)."""
    try:
        return float(stamp.read_text()) - launched
    except (OSError, ValueError):
        return None


def first_trial_seconds(rec: dict, launched: float) -> dict:
    """Seconds from the arm's launch to its first trial's start (the first trial step follows its
    data and model set-up) and to the end of that trial's first epoch, read from the arm's store."""
    return {key: (rec[ms] / 1000 - launched if rec.get(ms) else None)
            for key, ms in (("first_trial_s", "first_trial_start_ms"), ("first_epoch_s", "first_epoch_ms"))}


def epochs_trained(result: dict) -> int:
    """Epochs an arm's trials trained in all, from its store: what pruning left of n_trials x epochs."""
    return sum(run["epochs"] for run in result["records"].get("runs", []))


def study_row(name: str, rounds: list[dict[str, dict]]) -> dict:
    """The judged row of one study: sweeps' trials/min over the best peer's, per round."""
    def ok(r: dict, a: str) -> bool:
        return a in r and "error" not in r[a]

    good = [r for r in rounds if ok(r, "sweeps run") and any(ok(r, a) for a in PEERS)]
    target = f">= {TARGETS[name]}x the best peer's trials/min"
    arms_detail = {a: {"wall_s": stats(r[a]["wall_s"] for r in rounds if ok(r, a)),
                       "tpm": stats(r[a]["tpm"] for r in rounds if ok(r, a)),
                       "epochs": stats(epochs_trained(r[a]) for r in rounds if ok(r, a)),
                       **{k: stats(r[a][k] for r in rounds if ok(r, a) and r[a].get(k) is not None)
                          for k in ("first_step_s", "first_trial_s", "first_epoch_s")},
                       "errors": [r[a]["error"] for r in rounds if a in r and "error" in r[a]]} for a in ARMS}
    records = {a: next((r[a]["records"] for r in reversed(rounds) if ok(r, a)), {}) for a in ARMS}
    details = {"arms": arms_detail, "records": records, "records_table": table(records)}
    if not good:
        err = next((r[a]["error"] for r in rounds for a in ARMS if a in r and "error" in r[a]), "no round finished")
        return error_row(f"{name}: sweeps vs best peer", err, target=target, details=details)
    winners = [max((a for a in PEERS if ok(r, a)), key=lambda a, r=r: r[a]["tpm"]) for r in good]
    best = [r[a]["tpm"] for r, a in zip(good, winners, strict=True)]
    sweeps_tpm = [r["sweeps run"]["tpm"] for r in good]
    ratio = paired_ratio(sweeps_tpm, best, "sweeps run trials/min / the best peer's in the same round")
    details["sweeps_over_each_peer"] = {
        a: paired_ratio([r["sweeps run"]["tpm"] for r in good if ok(r, a)], [r[a]["tpm"] for r in good if ok(r, a)],
                        f"sweeps run / {a}") for a in PEERS}
    failed = [a for a in PEERS if arms_detail[a]["errors"]]
    return make_row(
        f"{name}: sweeps vs best peer", metric="trials per minute (whole study, wall time)",
        baseline=arm(f"best peer ({', '.join(sorted(set(winners)))})", best),
        candidate=arm("sweeps run", sweeps_tpm), ratio=ratio, target=target,
        meets_target=ratio["median"] >= TARGETS[name],
        headline=f"{ratio['median']:.2f}x the best peer ({winners[-1]}); " + ", ".join(
            f"{a} {arms_detail[a]['wall_s']['median']:.1f} s ({arms_detail[a]['epochs']['median']:.0f} epochs"
            + (f", first step at {arms_detail[a]['first_step_s']['median']:.1f} s)"
               if arms_detail[a]["first_step_s"]["n"] else ")")
            for a in ARMS if arms_detail[a]["wall_s"]["n"])
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        details=details)


def time_breakdown(ctx: Context, spec: dict, sweeps_result: dict | None) -> dict:
    """Where sweeps' time goes: its trial runs, and the pieces timed alone in a fresh process."""
    out: dict = {}
    if sweeps_result and "error" not in sweeps_result:
        out["from_trial_runs"] = breakdown.from_store(sweeps_result["tracking_uri"], spec["name"],
                                                      sweeps_result["wall_s"])
    steps = -(-1437 // 32)  # an epoch at batch 32 of the digits training split
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peers.breakdown", str(spec["task"]["args"]["width"]),
                           str(spec["train"]["epochs"]), str(steps)], cwd=ctx.workdir, env=sweeps_env(),
                          capture_output=True, text=True, timeout=ctx.pick(300, 600))
    if proc.returncode == 0:
        out["components"] = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        out["components_error"] = proc.stderr[-2000:]
    return out


def run(ctx: Context) -> dict:
    specs = studies(ctx)
    repeats = ctx.n_repeats(2)
    timeout_s = ctx.pick(300, 900)
    arms = [a for a in ARMS if a in ctx.options.get("arms", ARMS)]
    rows, all_rounds = [], {}
    for name, spec in specs.items():
        rounds: list[dict[str, dict]] = []
        last = 0.0
        for r in range(repeats):
            if r and not ctx.can_afford(1.1 * last, f"{name}: round {r + 1} of {repeats}"):
                break
            t_round, results = time.monotonic(), {}
            for a in (arms if r % 2 == 0 else arms[::-1]):
                ctx.log(f"{NAME}: {name}, {a} (round {r + 1}/{repeats})")
                try:
                    results[a] = run_arm(a, spec, ctx.workdir / f"{name}-{r}-{a.split()[0]}{len(results)}", timeout_s)
                except Exception as exc:  # noqa: BLE001 - a benchmark reports: the arm failed, say why
                    results[a] = {"error": f"{type(exc).__name__}: {exc}", "wall_s": 0.0, "tpm": 0.0}
                x = results[a]
                ctx.log("  " + (x["error"].splitlines()[0] if "error" in x else
                                f"{x['wall_s']:.1f} s, {x['trials']} trials, {x['tpm']:.1f} trials/min"))
            rounds.append(results)
            last = time.monotonic() - t_round
        all_rounds[name] = rounds
        rows.append(study_row(name, rounds))
        ctx.keep(rows)
    ctx.log(f"{NAME}: breakdown of sweeps run's time")
    base = "lr_bs_nopruning" if "lr_bs_nopruning" in specs else next(iter(specs))
    sweeps_last = next((r.get("sweeps run") for r in reversed(all_rounds[base])), None)
    split = time_breakdown(ctx, specs[base], sweeps_last)
    bits = [f"{r['case'].split(':')[0]} " + (f"{r['ratio']['median']:.2f}x" if r["status"] == "ok" else "failed")
            for r in rows]
    return {
        "target": "sweeps run >= 1.2x the best peer's trials/min on lr_bs without pruning, >= 1.0x on lr_bs "
                  "and the bigger CNN (issue 27)",
        "summary": "sweeps run trials/min over the best peer's (plain Optuna + MlflowClient at n_jobs 1 and 2, "
                   "optuna-integration MLflowCallback, Ray Tune + setup_mlflow): " + "; ".join(bits),
        "rows": rows,
        "notes": ["Every arm is a fresh process in a fresh folder with its own SQLite MLflow store; its wall "
                  "time is the whole study, process start-up and imports included.",
                  "Time to the first trial step (first_step_s, in the headline): from the arm's launch to the end "
                  "of the first optimizer step any of its processes takes, one clock for every arm (a global "
                  "torch.optim step hook that benchmarks/peers/step_clock registers in each of its processes).",
                  "What each arm recorded is read back from its store after the run (details.records, "
                  "details.records_table), counting trial runs holding each kind of record.",
                  "Epochs trained (in the headline) are counted from each arm's store: with a pruner they "
                  "depend on the points the sampler drew and on how many trials ran at once, since Optuna's "
                  "median pruner compares a trial with the trials completed so far.",
                  f"Breakdown of sweeps run's time from study {base} (details.breakdown)."],
        "details": {"studies": {n: {k: s[k] for k in ("task", "train", "search", "pruner", "budget")}
                                for n, s in specs.items()},
                    "rounds": all_rounds, "breakdown": split},
    }
