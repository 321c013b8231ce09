"""Run every benchmark and write ``benchmarks/results/<name>.json`` and ``benchmarks/RESULTS.md``.

    python -m benchmarks.run_all                 # the full suite (make bench): < 50 min on 2 CPU cores
    python -m benchmarks.run_all --quick         # tiny sizes, 1 repeat: checks every code path (~2 min)
    python -m benchmarks.run_all --only trainer_overhead,tracking_overhead

Each benchmark runs in its own process (a fresh interpreter: no state leaks from one measurement
into the next) with a time limit; a benchmark that fails or overruns is recorded as an error and
the suite goes on. The exit code is 0 whenever the suite ran: a benchmark reports, it never fails.
``--quick`` writes to a temp folder (printed) unless ``--out-dir`` is given, so it never replaces
the committed full results. RESULTS.md is rebuilt from every JSON in the results folder.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    RESULTS_DIR,
    RESULTS_MD,
    ROOT,
    SHARED_THRESHOLD_CORES,
    Context,
    CpuMonitor,
    fmt_stats,
    machine_info,
    new_result,
    write_result,
)

# name -> (section number, planned seconds in the full suite on 2 idle cores, time limit with --quick)
BENCHMARKS: dict[str, tuple[int, int, int]] = {
    "trainer_overhead": (1, 150, 120),
    "tracking_overhead": (2, 120, 90),
    "orchestration": (3, 75, 150),
    "parallel": (4, 200, 150),
    "search_efficiency": (5, 220, 150),
    "lr_finder": (6, 40, 90),
    "onnx_latency": (7, 100, 120),
    "gpu": (8, 5, 120),
    "peers": (9, 900, 900),
    "thousand_trials": (10, 600, 300),
    "packed": (11, 600, 400),
}
# Diagnostics: not in the default suite; run with --only NAME; shown in RESULTS.md when their JSON exists.
OPTIONAL: dict[str, tuple[int, int, int]] = {"trainer_ladder": (1, 150, 120)}
# The full suite ends within 50 minutes on 2 CPU cores, with 100 s of margin: the peer benchmark
# (three studies five ways) has 900 s of its own, the study of 2,000 one-step trials 600 s, the
# packed studies (three cases three ways) 600 s.
SUITE_BUDGET_S = 2900
GPU_LIMIT_S = 900  # gpu_check.py on a CUDA machine ("a few minutes"); on CPU the section is skipped at once


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.run_all", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 repeat: validate the code paths")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="results folder (default: benchmarks/results; with --quick a temp folder)")
    p.add_argument("--repeats", type=int, default=None, help="override every benchmark's number of repeats")
    p.add_argument("--jobs", type=int, default=None,
                   help="benchmarks run at once (default 1; 2 with --quick, whose numbers are not measurements)")
    p.add_argument("--gpu-dry-run", action="store_true",
                   help="run gpu_check.py --dry-run on CPU (exercises the GPU section without CUDA)")
    return p.parse_args(argv)


class Job:
    """One benchmark in its own process (new session, so a time-out can stop its whole tree)."""

    def __init__(self, name: str, out: Path, quick: bool, repeats: int | None, timeout_s: float, extra: list[str],
                 log_path: Path | None, budget_s: float | None = None, module: str | None = None) -> None:
        cmd = [sys.executable, "-m", "benchmarks", name, "--out", str(out)] + (["--module", module] if module else [])
        cmd += ["--quick"] if quick else []
        if repeats is not None:
            cmd += ["--repeats", str(repeats)]
        if budget_s is not None:
            cmd += ["--budget-s", f"{budget_s:.0f}"]
        cmd += extra
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.name, self.out, self.quick, self.timeout_s = name, out, quick, timeout_s
        if out.exists():
            out.unlink()
        self.log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in finish()
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=self.log,
                                     stderr=subprocess.STDOUT if self.log else None)

    def poll(self) -> bool:
        """True once the process has ended (or was stopped for running past its limit)."""
        if self.proc.poll() is not None:
            return True
        if time.perf_counter() - self.t0 > self.timeout_s:
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            self.timed_out = True
            return True
        return False

    def finish(self) -> dict:
        if self.log:
            self.log.close()
        problem = None
        if getattr(self, "timed_out", False):
            problem = f"stopped after {self.timeout_s:.0f} s, its time limit in this suite (benchmarks/run_all.py)"
        elif not self.out.exists():
            problem = f"benchmark process exited {self.proc.returncode} without writing {self.out.name}"
        elif self.proc.returncode != 0:  # bench_main exits 0 once it has written its final result
            problem = f"benchmark process exited {self.proc.returncode} before it finished"
        kept = json.loads(self.out.read_text()) if problem and self.out.exists() else None
        if kept is not None and kept.get("rows"):  # stopped mid-way: keep what it had measured (Context.keep)
            kept.update(status="partial", error=f"{problem}; the rows it had measured by then are kept",
                        wall_s=round(time.perf_counter() - self.t0, 2),
                        summary=kept["summary"].replace("stopped before it finished", problem, 1))
            write_result(kept, self.out)
        elif problem:  # the benchmark could not report: record that, in the same schema
            result = new_result(self.name, self.name, Context(quick=self.quick, workdir=Path(tempfile.gettempdir())))
            result.update(status="error", error=problem, summary=f"{self.name}: {problem}", machine=machine_info(),
                          wall_s=round(time.perf_counter() - self.t0, 2))
            write_result(result, self.out)
        return json.loads(self.out.read_text())


# --------------------------------------------------------------------------- RESULTS.md


def _met(row: dict, quick: bool) -> str:
    if row.get("status") == "error":
        return "error"
    m = row.get("meets_target")
    if m is None:
        return "-"
    return ("yes" if m else "**no**") + (" (quick)" if quick else "")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt_duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def render(results: list[dict], suite: dict | None) -> str:
    """The markdown report: machine, the headline table, then one section per benchmark."""
    quick = any(r.get("mode") == "quick" for r in results)
    machine = next((r["machine"] for r in results if r.get("machine")), None) or machine_info()
    v = machine.get("versions", {})
    lines = ["# Benchmark results", ""]
    lines.append("Generated by `make bench` (`python -m benchmarks.run_all`); every figure is a ratio against a "
                 "baseline measured in the same run (alternating baseline and candidate, ABAB), given as "
                 "median [min, max] over the repeats. See `benchmarks/README.md` for what each benchmark does.")
    lines.append("")
    if quick:
        lines += ["> **Quick mode** (`--quick`): tiny sizes and one repeat, to check the code paths. "
                  "These numbers mean nothing.", ""]
    lines += ["## Machine", ""]
    lines.append(f"- CPU: {machine.get('cpu_model')}, {machine.get('cpus_usable')} usable cores of "
                 f"{machine.get('cpu_count')}; RAM {machine.get('ram_gib')} GiB; torch's default intra-op threads "
                 f"{machine.get('torch_threads')} (benchmarks that set their own say so); "
                 f"CUDA {'yes' if machine.get('cuda_available') else 'no'}")
    lines.append(f"- Platform: {machine.get('platform')}")
    lines.append(f"- Versions: python {v.get('python')}, torch {v.get('torch')}, torchvision {v.get('torchvision')}, "
                 f"optuna {v.get('optuna')}, mlflow {v.get('mlflow')}, ray {v.get('ray')}, "
                 f"onnxruntime {v.get('onnxruntime')}, onnx {v.get('onnx')}, numpy {v.get('numpy')}")
    lines.append(f"- Commit: {machine.get('git_commit')}")
    if suite:
        lines.append(f"- Date: {suite['started_at']} (UTC); full-suite wall time {_fmt_duration(suite['wall_s'])}")
        load = suite.get("load", {})
        other = load.get("other_cores_avg")
        if other is not None:
            shared = other > SHARED_THRESHOLD_CORES
            la = load.get("loadavg_start") or [None]
            lines.append(
                f"- Shared machine: **{'yes' if shared else 'no'}**: other processes used on average {other:.2f} of "
                f"{load.get('cores')} cores while the suite ran (load average {la[0]:.1f} at the start)"
                + ("; the numbers are noisier than on an idle machine (per-benchmark load below)." if shared else "."))
    else:
        lines.append(f"- Date: {min((r.get('started_at') or '') for r in results)} (UTC)")
    lines += ["", "## Headline", ""]
    lines.append("| # | benchmark | case | baseline | candidate | ratio: median [min, max] (n) | result | target "
                 "| met |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        num = {**BENCHMARKS, **OPTIONAL}.get(r["name"], (0,))[0]
        if r.get("status") in ("skipped",) or not r.get("rows"):
            lines.append(f"| {num} | {r['name']} | - | - | - | - | {_cell(r.get('summary') or r.get('error') or '')} | "
                         f"{_cell(r.get('target') or '-')} | {r.get('status')} |")
            continue
        for row in r["rows"]:
            base, cand, ratio = row.get("baseline"), row.get("candidate"), row.get("ratio")
            lines.append(
                f"| {num} | {r['name']} | {_cell(row['case'])} | "
                f"{_cell((base or {}).get('label', '-'))}: {fmt_stats(base)} | "
                f"{_cell((cand or {}).get('label', '-'))}: {fmt_stats(cand)} | "
                f"{fmt_stats(ratio, 4)} ({(ratio or {}).get('n', 0)}) | {_cell(row.get('headline', ''))} | "
                f"{_cell(row.get('target') or '-')} | {_met(row, quick)} |")
    lines += ["", "## Per benchmark", ""]
    for r in results:
        num = {**BENCHMARKS, **OPTIONAL}.get(r["name"], (0,))[0]
        lines += [f"### {num}{'b' if r['name'] in OPTIONAL else ''}. {r.get('title', r['name'])}", ""]
        lines.append(f"{r.get('summary', '')}")
        lines.append("")
        load = r.get("load") or {}
        bits = [f"status **{r.get('status')}**", f"mode {r.get('mode')}", f"started {r.get('started_at')}",
                f"wall {r.get('wall_s')} s"]
        if load.get("other_cores_avg") is not None:
            bits.append(f"other processes' CPU {load['other_cores_avg']:.2f} cores on average")
        bits.append(f"`results/{r['name']}.json`")
        lines += ["- " + "; ".join(bits), f"- Target: {r.get('target') or '-'}"]
        for note in r.get("notes", []):
            lines.append(f"- {note}")
        if r.get("error"):
            lines += ["", "```", str(r["error"])[-1500:], "```"]
        lines += _extra_section(r)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _extra_section(r: dict) -> list[str]:
    """Benchmark-specific detail tables."""
    out: list[str] = []
    if r["name"] == "trainer_overhead":
        for row in r.get("rows", []):
            b = row.get("details", {}).get("breakdown")
            if not b:
                continue
            out += ["", f"Where core.train() spends extra time per optimizer step, {row['case']} "
                        f"(each timed in isolation; hand step {1e3 * b['hand_step_s']:.2f} ms):", "",
                    "| extra work per step in core.train() | us per step | % of a hand step |", "|---|---|---|"]
            for k, us in b["per_step_costs_us"].items():
                out.append(f"| {_cell(k)} | {us:.1f} | {b['per_step_costs_pct_of_hand_step'][k]:.2f}% |")
            out.append(f"| **sum** (predicts a ratio of {b['predicted_ratio']:.3f}) | {b['sum_of_extras_us']:.1f} | "
                       f"{b['sum_of_extras_pct']:.2f}% |")
    if r["name"] == "trainer_ladder":
        for row in r.get("rows", []):
            lad = row.get("details", {}).get("ladder")
            if not lad:
                continue
            out += ["", f"{row['case']}: core.train() in lockstep with the hand loop as pieces are taken out:", "",
                    "| variant | core / hand samples/s |", "|---|---|"]
            for name, v in lad.items():
                out.append(f"| {_cell(name)} | {fmt_stats(v, 4)} |")
            out.append("| hand loop | 1 |")
    if r["name"] == "peers":
        out += _peers_section(r)
    if r["name"] == "packed":
        out += ["", "| case | arm | seed | trials/min | wall s | whole records / trials | best objective "
                    "| GPU util % |", "|---|---|---|---|---|---|---|---|"]
        for case, arms in (r.get("details", {}).get("runs") or {}).items():
            for which, runs in arms.items():
                for x in runs:
                    if "error" in x:
                        failed = _cell(x["error"].splitlines()[0][:150])
                        out.append(f"| {case} | {which} | | failed: {failed} | | | | |")
                        continue
                    util = "-" if x.get("gpu_util_pct") is None else f"{x['gpu_util_pct']:.0f}"
                    best = "-" if x.get("best") is None else f"{x['best']:.4g}"
                    ran = ", ".join(f"{n} as {how}" for how, n in sorted(x.get("layouts", {}).items()))
                    which_ran = f"{which} ({ran})" if ran else which
                    out.append(f"| {case} | {which_ran} | {x.get('seed', 0)} | {x['tpm']:.1f} | {x['wall_s']:.1f} | "
                               f"{x['records']} / {x['trials']} | {best} | {util} |")
    if r["name"] == "orchestration":
        out += ["", "| backend | wall s | sum of trial_seconds | start-up s | extra in first trial s | "
                    "between trials s | shut-down s | overhead s/trial |", "|---|---|---|---|---|---|---|---|"]
        for backend, runs in (r.get("details", {}).get("runs") or {}).items():
            for x in runs:
                if "error" in x:
                    out.append(f"| {backend} | failed: {_cell(x['error'].splitlines()[0][:150])} | | | | | | |")
                    continue
                out.append(f"| {backend} | {x['wall_s']:.1f} | {x['sum_trial_s']:.1f} | {x['startup_s']:.1f} | "
                           f"{x.get('first_trial_extra_s', 0):.1f} | {x['between_trials_s']:.3f} | "
                           f"{x['shutdown_s']:.1f} | {x['per_trial_overhead_s']:.3f} |")
    if r["name"] == "gpu" and r.get("details", {}).get("gpu_check"):
        rep = r["details"]["gpu_check"]
        out += ["", "| gpu_check run | nproc | status | final train loss | samples/s |", "|---|---|---|---|---|"]
        for name, run in rep.get("runs", {}).items():
            out.append(f"| {name} | {run.get('nproc')} | {run.get('status')} | {run.get('final_train_loss', '-')} | "
                       f"{run.get('samples_per_s', '-')} |")
    return out


def collect(out_dir: Path) -> list[dict]:
    results = []
    for name in [*BENCHMARKS, *OPTIONAL]:
        path = out_dir / f"{name}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
    order = {**BENCHMARKS, **OPTIONAL}
    return sorted(results, key=lambda r: (order[r["name"]][0], r["name"] in OPTIONAL))


def _peers_section(r: dict) -> list[str]:
    """What each arm recorded (read from its store), per study, and where sweeps' time goes."""
    out: list[str] = []
    for row in r.get("rows", []):
        lines = row.get("details", {}).get("records_table")
        if lines:
            out += ["", f"{row['case'].split(':')[0]}: trial runs holding each record, read back from each arm's "
                        "MLflow store:", "", *lines]
    split = r.get("details", {}).get("breakdown", {})
    runs, parts = split.get("from_trial_runs", {}), split.get("components", {})
    if runs.get("trials"):
        out += ["", f"Where a sweeps run trial's time goes ({runs['trials']} trials, {runs['workers']} worker(s), "
                    f"medians): trial {runs['trial_s_median']:.2f} s = training loop "
                    f"{runs['train_loop_s_median']:.2f} s + the rest {runs['rest_of_trial_s_median']:.2f} s; "
                    f"outside the trials {runs['outside_trials_s_per_trial']:.2f} s per trial."]
    if parts:
        out += ["", "| piece, timed alone | seconds |", "|---|---|"]
        out += [f"| {_cell(k)} | {v:.3f} |" for k, v in parts.get("imports", {}).items()]
        out += [f"| {_cell(k)} | {v:.3f} |" for k, v in parts.items() if k.endswith("_s") and isinstance(v, float)]
        out += [f"| per trial: {_cell(k)} | {v:.3f} |" for k, v in parts.get("per_trial_estimate_s", {}).items()]
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(BENCHMARKS)
    known = {**BENCHMARKS, **OPTIONAL}
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    skip = {n.strip() for n in a.skip.split(",") if n.strip()}
    names = [n for n in names if n not in skip]
    if a.out_dir is not None:
        out_dir = a.out_dir
    elif a.quick:
        out_dir = Path(tempfile.gettempdir()) / "sweeps-bench-quick" / "results"
    else:
        out_dir = RESULTS_DIR
    md_path = RESULTS_MD if out_dir.resolve() == RESULTS_DIR.resolve() else out_dir.parent / "RESULTS.md"
    out_dir.mkdir(parents=True, exist_ok=True)

    monitor = CpuMonitor()
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    t0 = time.perf_counter()
    print(f"benchmarks: {', '.join(names)} ({'quick' if a.quick else 'full'}) -> {out_dir}", flush=True)
    jobs = a.jobs or (2 if a.quick else 1)
    log_dir = out_dir.parent / "logs" if jobs > 1 else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"{jobs} at a time; logs in {log_dir}", flush=True)
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            _, planned, quick_limit = known[name]
            extra = ["--opt", "dry_run=true"] if name == "gpu" and a.gpu_dry_run else []
            budget, limit = None, float(quick_limit)
            if not a.quick:
                # Share what is left of the suite's budget in proportion to the plan: a benchmark that
                # overran shortens the next ones' optional repeats; the hard limit leaves room for the
                # part of a benchmark that cannot be cut (one sweeps run, one export).
                left = SUITE_BUDGET_S - (time.perf_counter() - t0)
                planned_left = sum(known[n][1] for n in [name] + pending)
                budget = max(0.4 * planned, min(1.5 * planned, planned * left / planned_left))
                limit = GPU_LIMIT_S if name == "gpu" else 1.3 * budget + 60
            running.append(Job(name, out_dir / f"{name}.json", a.quick, a.repeats, limit, extra,
                               log_dir / f"{name}.log" if log_dir else None, budget))
        time.sleep(0.2)
        for job in [j for j in running if j.poll()]:
            running.remove(job)
            result = job.finish()
            print(f"== {job.name}: {result.get('status')} in {time.perf_counter() - job.t0:.0f} s: "
                  f"{result.get('summary')}", flush=True)
    wall = time.perf_counter() - t0
    suite = {"started_at": started, "wall_s": wall, "load": monitor.result(), "benchmarks": names,
             "mode": "quick" if a.quick else "full"}
    complete = set(names) == set(BENCHMARKS)
    if complete:  # a partial rerun keeps the last full suite's record
        (out_dir / "suite.json").write_text(json.dumps(suite, indent=2) + "\n")
    elif (out_dir / "suite.json").exists():
        suite = json.loads((out_dir / "suite.json").read_text())
    else:
        suite = None
    md_path.write_text(render(collect(out_dir), suite))
    print(f"\nsuite wall time {_fmt_duration(wall)}; wrote {md_path} and {out_dir}/*.json", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
