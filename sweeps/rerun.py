"""``sweeps rerun``: train a trial again from what its MLflow run recorded, then compare
every metric curve with the original, step by step.

The trial is rebuilt from its ``config/resolved_config.json`` artifact (the full train
config, the task section and the sampled params), never from the spec as it is now, so a
rerun works for either backend and after the spec changed. The rerun is a new MLflow run in
the same experiment (role ``rerun``, tag ``rerun_of``), nested under the study's parent run,
trained by the same ``core.train`` with the same reporter a trial uses; it prints a line per
epoch (metrics, elapsed time) while it trains.

On CPU a rerun uses this process's thread count (``torch.get_num_threads()``, the machine's
unless ``OMP_NUM_THREADS`` or ``--threads`` says otherwise), not the original's: a trial of a
study shares the machine and may have had one thread. CPU kernels split their sums by thread,
so another count changes the last bits (the digits CNN's step curves part at the second
step between 1 and 2 threads); a rerun with the original seed, the same code and
``--threads`` set to the original's count (recorded in its ``sweeps.device`` tag) reproduces
the original curves bit for bit, and the rerun says which count it used and warns otherwise.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

from core.config import apply_overrides
from core.ddp_launch import TaskSpec, train_distributed
from core.train import train
from sweeps.compare import CurveComparison, best_over_epochs, compare_curves, compared_metric, metric_curve, open_client
from sweeps.parent_run import git_commit, package_versions
from sweeps.resolved_config import config_from_resolved, load_resolved_config, task_from_resolved
from sweeps.safe_names import safe_component
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle
from sweeps.tracking.reader import TrackingReader
from sweeps.trial import TrialOutcome, finish_trial_run
from sweeps.trial_control import TrialControl
from sweeps.trial_reporter import TrialReporter

if TYPE_CHECKING:
    from core.reporting import Decision
    from sweeps.tracking.mlflow_tracker import MlflowTracker

_CPU_THREADS = re.compile(r"^cpu \((\d+) threads?\)")
_QUIET_METRICS = frozenset({"grad_norm", "skipped_steps"})  # kept in the run, left out of the progress line


# ---- rebuild a trial from its run --------------------------------------------------------------
def parent_handle(reader: TrackingReader, run) -> RunHandle | None:
    """The study's parent run of ``run`` as a handle, if it still exists."""
    parent_id = run.data.tags.get(layout.PARENT_TAG)
    if not parent_id:
        return None
    try:
        return reader.handle(parent_id)
    except Exception:  # noqa: BLE001 - a deleted or foreign parent: the rerun is simply not nested
        return None


def code_differences(reader: TrackingReader, run) -> list[str]:
    """How the code now differs from the code that ran ``run``: the git commit (trial tag, else
    the study's parent run) and the package versions (``version.*`` params of the parent)."""
    parent = None
    parent_id = run.data.tags.get(layout.PARENT_TAG)
    if parent_id:
        with contextlib.suppress(Exception):
            parent = reader.get_run(parent_id)
    then_commit = run.data.tags.get(layout.TAG_GIT_COMMIT) or (parent.data.tags.get(layout.TAG_GIT_COMMIT)
                                                               if parent is not None else None)
    out = []
    now_commit = git_commit()
    if then_commit and then_commit != now_commit:
        out.append(f"git commit {then_commit} (original) vs {now_commit} (now)")
    if parent is not None:
        now = package_versions()
        for key, then in sorted(parent.data.params.items()):
            if key.startswith("version."):
                name = key[len("version."):]
                if name in now and now[name] != then:
                    out.append(f"{name} {then} (original) vs {now[name]} (now)")
    return out


# ---- one rerun ---------------------------------------------------------------------------------
@dataclass
class RerunOutcome:
    run_id: str
    seed: int
    objective: float | None  # best value of the study objective over the rerun's epochs
    comparison: CurveComparison
    code_diffs: list[str]
    thread_note: str = ""  # why the curves may differ: another CPU thread count than the original's


def original_threads(device_tag: str) -> int | None:
    """The CPU thread count a trial ran on, from its ``sweeps.device`` tag ("cpu (4 threads)")."""
    found = _CPU_THREADS.match(device_tag or "")
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def _cpu_threads(n: int | None):
    """Train on ``n`` CPU threads (None: leave the count as it is), restored afterwards."""
    import torch

    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _on_cpu(cfg) -> bool:
    import torch

    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


class ProgressReporter:
    """The trial's reporter, passed through, that also prints one line per epoch (the
    objective, the losses and curves, the time since training began): a rerun of a long trial
    would otherwise say nothing for minutes."""

    def __init__(self, inner: TrialReporter, console: Any, epochs: int) -> None:
        self.inner, self.console, self.epochs = inner, console, epochs
        self.started = time.monotonic()

    def report_step(self, step: int, metrics: dict[str, float]) -> Decision:
        return self.inner.report_step(step, metrics)

    def report_epoch(self, epoch: int, step: int, metrics: dict[str, float]) -> Decision:
        decision = self.inner.report_epoch(epoch, step, metrics)
        objective = self.inner.objective
        shown = [objective] + sorted(k for k in metrics
                                     if k != objective and compared_metric(k) and k not in _QUIET_METRICS)
        values = "  ".join(f"{k}={metrics[k]:.4g}" for k in shown if k in metrics)
        self.console.print(f"epoch {epoch}/{self.epochs}  {values}  elapsed {time.monotonic() - self.started:.1f}s",
                           markup=False, highlight=False)
        return decision

    def resumed(self, epochs: list, steps: list) -> None:
        self.inner.resumed(epochs, steps)

    def log_artifact(self, path: Path, kind: str) -> None:
        self.inner.log_artifact(path, kind)


def _pin_device(cfg, device_tag: str, console):
    """``device: auto`` resolved to what the original ran on, so a CPU trial reruns on CPU."""
    import torch

    if cfg.device != "auto":
        return cfg
    if device_tag.startswith("cpu"):
        return apply_overrides(cfg, {"device": "cpu"})
    if device_tag.startswith("cuda") and not torch.cuda.is_available():
        console.print(Text("warning: the original ran on CUDA, this rerun runs on CPU: expect the curves to "
                           "differ", style="yellow"))
    return cfg


def rerun_once(tracker: MlflowTracker, original_id: str, seed: int | None = None, parent: RunHandle | None = None,
               console=None, out_root: str | Path = "runs", reader: TrackingReader | None = None,
               threads: int | None = None, profile: bool = False) -> RerunOutcome:
    """Train the trial of run ``original_id`` again (``seed`` replaced when given), logged as a
    new run; then compare its curves with the original's and tag the verdict on the new run.
    ``reader``: what reads the original (default: one on the tracker's store). ``threads``: CPU
    threads to train on (default: this process's count; see the module's docstring). ``profile``:
    run torch.profiler over a few steps (``train.profile``, its defaults unless the trial set it)."""
    import torch

    reader = reader or open_client(tracker.tracking_uri)
    orig = reader.get_run(original_id)
    resolved = load_resolved_config(reader, original_id)
    tags = orig.data.tags
    device_tag = tags.get(layout.TAG_DEVICE, "")
    cfg = _pin_device(config_from_resolved(resolved, original_id, seed), device_tag, console)
    if profile and cfg.profile is None:
        cfg = apply_overrides(cfg, {"profile": {}})
    then_threads = original_threads(device_tag)
    cpu = _on_cpu(cfg)
    threads = (threads or torch.get_num_threads()) if cpu else None
    thread_note = _thread_note(threads, then_threads)
    code_diffs = code_differences(reader, orig)
    if code_diffs and console is not None:
        console.print(Text("warning: the code differs from the original's (the rerun goes on; differences in the "
                           "curves may come from this): " + "; ".join(code_diffs), style="yellow"))
    task = task_from_resolved(resolved)
    objective = resolved.get("objective") or {}
    metric = objective.get("metric", "val_loss")
    study = resolved.get("study") or tags.get(layout.TAG_STUDY) or "rerun"
    parent = parent if parent is not None else parent_handle(reader, orig)
    run = tracker.start_run(_rerun_name(reader, orig, cfg.seed, threads),
                            experiment=reader.experiment_name(orig.info.experiment_id), parent=parent, tags={
                                layout.TAG_ROLE: layout.ROLE_RERUN, layout.TAG_RERUN_OF: original_id,
                                layout.TAG_STUDY: study, layout.TAG_TRIAL_NUMBER: tags.get(layout.TAG_TRIAL_NUMBER, ""),
                                layout.TAG_SEED: cfg.seed, layout.TAG_SPEC_HASH: resolved.get("spec_hash", ""),
                                layout.TAG_GIT_COMMIT: git_commit(),
                                layout.TAG_DEVICE: f"cpu ({threads} threads)" if threads else device_tag,
                                "sweeps.rerun.threads": threads or "",
                                "sweeps.rerun.original_threads": then_threads or "",
                                "sweeps.code_differs": str(bool(code_diffs)).lower(),
                                "sweeps.code_diff": "; ".join(code_diffs)})
    tracker.log(run, params={**orig.data.params, "seed": cfg.seed, "device": cfg.device})
    tracker.log_artifact(run, {**resolved, "seed": cfg.seed, "train": cfg.to_dict(), "rerun_of": original_id},
                         layout.ART_CONFIG)
    # A pruned original stopped early: the rerun stops after the same epoch, so both trained alike.
    stop_after = (len([s for s in metric_curve(reader, original_id, metric) if s >= 1])
                  if tags.get(layout.TAG_PRUNED) == "true" else None)
    limit = stop_after or 0
    reporter: Any = TrialReporter(tracker, run, metric,
                                  TrialControl(should_prune=lambda epoch, value: limit > 0 and epoch >= limit))
    if console is not None:
        reporter = ProgressReporter(reporter, console, stop_after or cfg.epochs)
    out_dir = Path(out_root) / safe_component(study, "study name") / "reruns" / run.run_id
    if console is not None:
        console.print(f"rerun of {original_id} (trial {tags.get(layout.TAG_TRIAL_NUMBER, '?')}, seed {cfg.seed}) "
                      f"as run {run.run_id}, {cfg.epochs} epochs on {cfg.device}"
                      + (f", {threads} CPU thread{'s' if threads != 1 else ''}" if threads else "") + " ...",
                      markup=False, highlight=False)
        if thread_note:
            console.print(Text("warning: " + thread_note, style="yellow"))
        if stop_after:
            console.print(f"the original was pruned after epoch {stop_after}; the rerun stops there too",
                          markup=False, highlight=False)
    started = time.monotonic()
    try:
        with _cpu_threads(threads):
            if cfg.distributed.nproc > 1:  # DDP inside the trial, like sweeps.trial runs it
                section = resolved["task"]
                args = dict(section.get("args") or {})
                model = args.pop("model", section.get("model"))
                recipe = TaskSpec(name=section.get("name"), target=section.get("target"), model=model, args=args)
                result = train_distributed(recipe, cfg, reporter=reporter, out_dir=out_dir)
            else:
                result = train(task, cfg, reporter=reporter, out_dir=out_dir)
    except BaseException as exc:
        tracker.log(run, tags={layout.TAG_ERROR: f"{type(exc).__name__}: {exc}"[:500]})
        tracker.end_run(run, "FAILED")
        raise
    state = {"completed": "COMPLETE", "interrupted": "INTERRUPTED"}.get(result.status, "PRUNED")
    outcome = TrialOutcome(state, result.best_metric, result.reason, run, result,  # type: ignore[arg-type]
                           seconds=time.monotonic() - started)
    finish_trial_run(tracker, run, outcome)  # same final metrics and tags as a trial; flushes and ends
    comparison = compare_curves(reader, original_id, run.run_id)
    tracker.log(run, tags=comparison.tags())
    return RerunOutcome(run.run_id, cfg.seed, result.best_metric, comparison, code_diffs, thread_note)


def _rerun_name(reader: TrackingReader, orig, seed: int, threads: int | None) -> str:
    """``rerun-trial-3-seed0-threads1``, with ``-2``, ``-3``... after it when the original has a
    rerun of that name already: each rerun is told apart in MLflow's runs table."""
    base = (f"rerun-{orig.info.run_name or orig.info.run_id[:8]}-seed{seed}"
            + (f"-threads{threads}" if threads else ""))
    taken = {r.info.run_name for r in reader.find_runs(orig.info.experiment_id, {
        layout.TAG_ROLE: layout.ROLE_RERUN, layout.TAG_RERUN_OF: orig.info.run_id})}
    return next(name for n in itertools.count(1) if (name := base if n == 1 else f"{base}-{n}") not in taken)


def _thread_note(threads: int | None, then: int | None) -> str:
    """Why a CPU rerun may part from its original in the last bits, or "" when it should not."""
    if threads is None or then is None or threads == then:
        return ""
    return (f"this rerun trains on {threads} CPU threads, the original on {then}: CPU kernels split their sums by "
            f"thread, so the curves may differ in the last bits; rerun with --threads {then} for a bitwise "
            "reproduction")


def print_outcome(outcome: RerunOutcome, console) -> None:
    console.print(outcome.comparison.table())
    style = "green" if outcome.comparison.identical else "red" if outcome.comparison.nothing_to_compare else "yellow"
    console.print(Text(f"verdict (seed {outcome.seed}, run {outcome.run_id}): {outcome.comparison.verdict()}",
                       style=style))
    if outcome.thread_note and not outcome.comparison.identical:
        console.print(Text("note: " + outcome.thread_note, style="yellow"))


# ---- several seeds -----------------------------------------------------------------------------
def seed_statistics(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; NaN for a single value: one seed measures no spread)."""
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else math.nan)


def _std_text(std: float | None) -> str:
    return "std n/a (one seed)" if std is None or math.isnan(std) else f"std {std:.6g} (sample, n-1)"


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def rerun_seeds(tracker: MlflowTracker, original_id: str, seeds: list[int], console=None,
                out_root: str | Path = "runs", reader: TrackingReader | None = None,
                threads: int | None = None) -> dict[str, Any]:
    """Rerun the trial once per seed, nested under a run of its own (role ``seeds``) that holds
    the objective per seed (step = seed) and its mean and standard deviation."""
    reader = reader or open_client(tracker.tracking_uri)
    orig = reader.get_run(original_id)
    resolved = load_resolved_config(reader, original_id)
    objective = resolved.get("objective") or {}
    metric, direction = objective.get("metric", "val_loss"), objective.get("direction", "minimize")
    original_value = best_over_epochs(metric_curve(reader, original_id, metric), direction)
    tags = orig.data.tags
    run = tracker.start_run(f"seeds-{orig.info.run_name or original_id[:8]}",
                            experiment=reader.experiment_name(orig.info.experiment_id),
                            parent=parent_handle(reader, orig), tags={
                                layout.TAG_ROLE: layout.ROLE_SEEDS, layout.TAG_RERUN_OF: original_id,
                                layout.TAG_STUDY: tags.get(layout.TAG_STUDY, ""),
                                layout.TAG_TRIAL_NUMBER: tags.get(layout.TAG_TRIAL_NUMBER, "")})
    tracker.log(run, params={"seeds": ",".join(map(str, seeds)), "objective.metric": metric,
                             "objective.direction": direction, "rerun_of": original_id})
    outcomes: list[RerunOutcome] = []
    try:
        for seed in seeds:
            outcome = rerun_once(tracker, original_id, seed=seed, parent=run, console=console, out_root=out_root,
                                 reader=reader, threads=threads)
            outcomes.append(outcome)
            if console is not None and str(seed) == tags.get(layout.TAG_SEED):  # the original's: a reproduction
                print_outcome(outcome, console)
            elif console is not None:  # another seed trains another model: its curves differ by design
                console.print(Text(f"seed {seed}: {metric} {_shown(outcome.objective)} (run {outcome.run_id}); the "
                                   f"original trained with seed {tags.get(layout.TAG_SEED, '?')}"))
            if outcome.objective is not None:
                tracker.log_metrics(run, {"objective": outcome.objective, metric: outcome.objective}, seed)
    except BaseException:
        tracker.end_run(run, "FAILED")
        raise
    mean, std = seed_statistics([math.nan if o.objective is None else o.objective for o in outcomes])
    summary = {"run_id": run.run_id, "metric": metric, "direction": direction, "seeds": seeds,
               "values": {o.seed: o.objective for o in outcomes}, "mean": mean,
               "std": None if math.isnan(std) else std,
               "original": original_value, "rerun_run_ids": {o.seed: o.run_id for o in outcomes}}
    spread = {} if math.isnan(std) else {"objective_std": std, f"{metric}_std": std}
    tracker.log_metrics(run, {"objective_mean": mean, f"{metric}_mean": mean, **spread,
                              "n_seeds": float(len(outcomes))}, 0)
    tracker.log(run, tags={"sweeps.seed_runs": json.dumps(summary["rerun_run_ids"]),
                           "sweeps.seeds.summary": f"{metric} mean {mean:.6g} {_std_text(std)} over seeds "
                                                   f"{','.join(map(str, seeds))}"})
    tracker.log_artifact(run, summary, "seeds/summary.json")
    tracker.end_run(run, "FINISHED")
    return summary


def print_seed_summary(summary: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"{summary['metric']} (best over epochs, {summary['direction']}) per seed",
              title_justify="left")
    t.add_column("seed")
    t.add_column(summary["metric"])
    t.add_column("rerun run")
    for seed in summary["seeds"]:
        value = summary["values"].get(seed)
        t.add_row(str(seed), "-" if value is None else f"{value:.6g}", summary["rerun_run_ids"].get(seed, "-"))
    console.print(t)
    original = summary["original"]
    console.print(Text(f"{summary['metric']}: mean {summary['mean']:.6g}, {_std_text(summary['std'])} "
                       f"over {len(summary['seeds'])} seeds; original "
                       f"{'-' if original is None else format(original, '.6g')}; logged on run {summary['run_id']} "
                       f"(role seeds)"))
