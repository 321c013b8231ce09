"""Where ``core.train()`` loses time against the hand loop, measured inside the real loop.

A diagnostic for benchmark 1 (not in the default suite; ``python -m benchmarks.run_all --only
trainer_ladder`` or ``python -m benchmarks.bench_trainer_ladder``). The per-step costs in
``trainer_overhead`` are timed in isolation; this one takes pieces out of the real
``core.train()`` one at a time (by patching them for the run, core's code is not changed) and
measures the median optimizer step, in process CPU time and wall time, of each variant:

  core                  core.train() + TrialReporter on a real MlflowTracker (as in benchmark 1)
  - grad norm           clip_grad_norm_ replaced by a stub returning 1.0 (no norm, no x1.0 rescale)
  - reporter            ... and a NullReporter instead of the TrialReporter
  - DistributedSampler  ... and the hand loop's RandomSampler instead
  hand                  the hand-written loop of benchmark 1

Variants alternate round by round (ABCDE ABCDE ...); the ratios are hand / variant per round.
Minor page faults per step are counted too: the kernel's page zeroing is CPU time of the step.
What remains between the last core variant and the hand loop is the loop itself: the loss and
accuracy ``.item()`` calls, ``loss / group_size``, the bookkeeping.
"""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from unittest import mock

from benchmarks.common import Context, bench_main, make_row, paired_ratio, stats

NAME = "trainer_ladder"
TITLE = "Trainer overhead, located: core.train() with its per-step extras removed one at a time"
VARIANTS = ("core", "- grad norm", "- reporter", "- DistributedSampler", "hand")


def _stub_clip(parameters, max_norm, *args, **kwargs):
    import torch

    return torch.tensor(1.0)


def _plain_train_loader(ds, cfg, device, ctx):
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    class Sampler(RandomSampler):
        def set_epoch(self, epoch: int) -> None:  # core calls it every epoch
            pass

    gen = torch.Generator().manual_seed(cfg.seed)
    return DataLoader(ds, batch_size=cfg.batch_size, sampler=Sampler(ds, generator=gen), num_workers=0)


def _fault_clock():
    from benchmarks.bench_trainer_overhead import StepClock, minor_faults

    class FaultClock(StepClock):
        """StepClock that also counts minor page faults per step."""

        def report_step(self, step, metrics):
            self.stamps[-1].append((time.perf_counter(), time.process_time(), minor_faults()))
            return self.inner.report_step(step, metrics)

    return FaultClock


def core_variant(task, cfg, store, level: int) -> dict:
    """level 0: core as is; 1: no grad norm; 2: also NullReporter; 3: also RandomSampler."""
    from core.reporting import NullReporter
    from core.train import train

    FaultClock = _fault_clock()
    with ExitStack() as stack:
        if level >= 1:
            stack.enter_context(mock.patch("torch.nn.utils.clip_grad_norm_", _stub_clip))
        if level >= 3:
            stack.enter_context(mock.patch("core.train.make_train_loader", _plain_train_loader))
        run = None
        if level >= 2:
            reporter = NullReporter()
        else:
            reporter, run = store.trial_reporter("ladder")
        clock = FaultClock(reporter)
        train(task, cfg, reporter=clock)
        if run is not None:
            store.tracker.end_run(run, "FINISHED")
    cpu, wall, faults = clock.intervals(1), clock.intervals(0), clock.intervals(2)
    nan = float("nan")
    return {"step_cpu_s": statistics.median(cpu) if cpu else nan, "step_s": statistics.median(wall) if wall else nan,
            "step_faults": statistics.median(faults) if faults else nan}


def run(ctx: Context) -> dict:
    from benchmarks.bench_trainer_overhead import cases, hand_loop, make_task, train_config
    from benchmarks.sweeps_runs import TrackingStore

    threads = ctx.torch_threads()
    store = TrackingStore(ctx.workdir / "mlflow")
    rows, notes = [], []
    only = ctx.options.get("cases", ["digits_cnn", "resnet18_synthetic32"])
    for case_name, case in cases(ctx).items():
        if case_name not in only:
            continue
        if case_name.startswith("resnet"):
            case = {**case, "epochs": ctx.pick(1, 2), "max_steps": ctx.pick(2, 4)}
        task = make_task(case["task"])
        cfg = train_config(case)
        rounds = int(ctx.options.get("rounds", ctx.pick(1, 5 if case_name == "digits_cnn" else 2)))
        ctx.log(f"{NAME}: {case_name}: {len(VARIANTS)} variants x {rounds} rounds")
        core_variant(task, train_config({**case, "epochs": 1, "max_steps": 2}), store, 0)  # warm caches
        values: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            t_round = time.monotonic()
            for level, name in enumerate(VARIANTS):
                if name == "hand":
                    out = hand_loop(task, cfg, faults=True)
                    out = {"step_cpu_s": out["step_cpu_s"], "step_s": out["step_interval_s"],
                           "step_faults": out["step_faults"]}
                else:
                    out = core_variant(task, cfg, store, level)
                values[name].append(out)
                ctx.log(f"  round {r + 1} {name}: step {1e3 * out['step_cpu_s']:.3f} ms CPU, "
                        f"{out['step_faults']:.0f} minor page faults")
            if r + 1 < rounds and not ctx.can_afford(1.1 * (time.monotonic() - t_round), f"{case_name} round {r + 2}"):
                break
        hand_cpu = [v["step_cpu_s"] for v in values["hand"]]
        ladder = {}
        for name in VARIANTS[:-1]:
            cpu = [v["step_cpu_s"] for v in values[name]]
            ladder[name] = {"step_cpu_ms": stats(1e3 * c for c in cpu),
                            "step_minor_faults": stats(v["step_faults"] for v in values[name]),
                            "ratio_cpu": paired_ratio(hand_cpu, cpu, f"hand step CPU / '{name}' step CPU"),
                            "ratio_wall": paired_ratio([v["step_s"] for v in values["hand"]],
                                                       [v["step_s"] for v in values[name]],
                                                       f"hand step wall / '{name}' step wall")}
        hand_ms = statistics.median(hand_cpu) * 1e3
        hand_faults = statistics.median(v["step_faults"] for v in values["hand"])
        steps = [ladder[n]["step_cpu_ms"]["median"] for n in VARIANTS[:-1]] + [hand_ms]
        parts = {f"{VARIANTS[i + 1]} saves": steps[i] - steps[i + 1] for i in range(len(VARIANTS) - 2)}
        parts["rest of the loop (the step read, accuracy sum, loss / group_size, bookkeeping)"] = steps[-2] - steps[-1]
        pct = {k: 100 * v / hand_ms for k, v in parts.items()}
        rows.append(make_row(
            case_name, metric="median optimizer step, process CPU ms",
            baseline={"label": "hand loop", **stats(1e3 * c for c in hand_cpu)},
            candidate={"label": "core.train() + TrialReporter", **ladder["core"]["step_cpu_ms"]},
            ratio=ladder["core"]["ratio_cpu"],
            headline=f"core step {steps[0]:.3f} ms vs hand {hand_ms:.3f} ms CPU, minor page faults per step "
                     f"{ladder['core']['step_minor_faults']['median']:.0f} vs {hand_faults:.0f}; "
                     + ", ".join(f"{k} {v:+.2f}%" for k, v in pct.items()),
            details={"ladder": ladder, "ms_per_step": parts, "pct_of_hand_step": pct, "rounds": rounds,
                     "hand_step_minor_faults": stats(v["step_faults"] for v in values["hand"])}))
    return {
        "target": "none (diagnostic for benchmark 1)",
        "summary": "Trainer overhead, located (share of a hand step, CPU time): " + "; ".join(
            f"{r['case']}: " + ", ".join(f"{k.split(' (')[0]} {v:+.1f}%" for k, v in r["details"]["pct_of_hand_step"].items())
            for r in rows),
        "rows": rows,
        "notes": [f"torch threads: {threads}. Each step of the ladder removes one more piece of core's per-step "
                  "work; 'saves' is how much the median step got shorter (negative: noise larger than the piece)."]
                 + notes,
        "details": {},
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(NAME, TITLE, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
