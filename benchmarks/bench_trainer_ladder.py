"""Where ``core.train()`` loses time against the hand loop, measured inside the real loop.

A diagnostic for benchmark 1 (not in the default suite; ``python -m benchmarks.run_all --only
trainer_ladder`` or ``python -m benchmarks trainer_ladder``). The per-step costs in
``trainer_overhead`` are timed in isolation; this one takes pieces out of the real
``core.train()`` one at a time (by patching them for the run, core's code is not changed) and
measures each variant in lockstep with the hand loop (``benchmarks/hand_loop.py``):

  core                  core.train() + TrialReporter on an MlflowTracker (as in benchmark 1)
  - reporter            a NullReporter instead of the TrialReporter
  - grad norm           ... and StepGradients.norm (core/gradients.py) replaced by a constant
  - DistributedSampler  ... and core.data's batches (an in-memory dataset's gathered batches, or
                        the DistributedSampler with per-batch data seeds) replaced by a plain
                        DataLoader on the hand loop's RandomSampler

Variants alternate run by run (ABCD ABCD ...); each run's ratio is the hand loop's summed step
time over the variant's, step for step. What remains between the last variant and 1.0 is the
loop itself: the accuracy sum, the step read, ``loss / group_size``, the bookkeeping.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from unittest import mock

from benchmarks.common import Context, make_row, stats

NAME = "trainer_ladder"
TITLE = "Trainer overhead, located: core.train() with its per-step extras removed one at a time"
VARIANTS = ("core", "- reporter", "- grad norm", "- DistributedSampler")


def _plain_train_loader(ds, cfg, device, ctx, collate_fn=None):
    import itertools

    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from core.data import TrainBatches

    class Plain(TrainBatches):  # what core.train asks of its train loader, on a plain DataLoader
        def epoch(self, epoch: int, start: int = 0):
            return itertools.islice(enumerate(self.loader), start, self.batches)

    gen = torch.Generator().manual_seed(cfg.seed)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=RandomSampler(ds, generator=gen), num_workers=0)
    return Plain(loader, min(len(loader), cfg.max_steps_per_epoch or len(loader)))


def core_variant(task, cfg, store, level: int) -> float:
    """level 0: core as is; 1: NullReporter; 2: also no grad norm; 3: also RandomSampler.
    Returns the run's lockstep ratio (hand step time / core step time)."""
    from benchmarks.hand_loop import HandStepper, Lockstep
    from core.reporting import NullReporter
    from core.train import train

    with ExitStack() as stack:
        if level >= 2:
            stack.enter_context(mock.patch("core.gradients.StepGradients.norm", lambda self: 1.0))
        if level >= 3:
            stack.enter_context(mock.patch("core.train.make_train_loader", _plain_train_loader))
        run = None
        if level >= 1:
            reporter = NullReporter()
        else:
            reporter, run = store.trial_reporter("ladder")
        pace = Lockstep(reporter, HandStepper(task, cfg))  # both sides start with a new model
        train(task, cfg, reporter=pace)
        if run is not None:
            store.tracker.end_run(run, "FINISHED")
    return pace.ratio()


def run(ctx: Context) -> dict:
    from benchmarks.bench_trainer_overhead import cases, make_task, train_config
    from benchmarks.sweeps_runs import TrackingStore

    threads = ctx.torch_threads()
    store = ctx.closing(TrackingStore(ctx.workdir / "mlflow"))
    rows = []
    only = ctx.options.get("cases", ["digits_cnn", "resnet18_synthetic32"])
    for case_name, case in cases(ctx).items():
        if case_name not in only:
            continue
        case = {**case, **case.get("lockstep", {})}
        task = make_task(case["task"])
        cfg = train_config(case)
        rounds = int(ctx.options.get("rounds", ctx.pick(1, 7 if case_name == "digits_cnn" else 2)))
        ctx.log(f"{NAME}: {case_name}: {len(VARIANTS)} variants x {rounds} rounds")
        core_variant(task, train_config({**case, "epochs": 1, "max_steps": 3}), store, 0)  # warm caches
        values: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            t_round = time.monotonic()
            for level, name in enumerate(VARIANTS):
                values[name].append(core_variant(task, cfg, store, level))
                ctx.log(f"  round {r + 1} {name}: core/hand {values[name][-1]:.4f}")
            if r + 1 < rounds and not ctx.can_afford(1.1 * (time.monotonic() - t_round), f"{case_name} round {r + 2}"):
                break
        ladder = {name: stats(values[name]) for name in VARIANTS}
        medians = [ladder[n]["median"] for n in VARIANTS] + [1.0]
        pct = {f"{VARIANTS[i + 1]} saves": 100 * (medians[i + 1] - medians[i]) for i in range(len(VARIANTS) - 1)}
        pct["rest of the loop (accuracy sum, step read, bookkeeping)"] = 100 * (1.0 - medians[len(VARIANTS) - 1])
        rows.append(make_row(
            case_name, metric="samples/s ratio, core variant / hand loop, in lockstep",
            baseline={"label": "hand loop", **stats([1.0] * len(values["core"]))},
            candidate={"label": "core.train() + TrialReporter", **ladder["core"]},
            ratio={**ladder["core"], "definition": "per run: hand step time / core step time, summed over the "
                                                   "run's lockstep pairs"},
            headline=f"core {medians[0]:.3f}x the hand loop; " + ", ".join(f"{k} {v:+.2f}%" for k, v in pct.items()),
            details={"ladder": ladder, "pct_of_hand_throughput": pct, "rounds": rounds}))
    return {
        "target": "none (diagnostic for benchmark 1)",
        "summary": "Trainer overhead, located (points of the hand loop's throughput): " + "; ".join(
            f"{r['case']}: " + ", ".join(f"{k.split(' (')[0]} {v:+.1f}" for k, v in
                                         r["details"]["pct_of_hand_throughput"].items())
            for r in rows),
        "rows": rows,
        "notes": [f"torch threads: {threads}. Each step of the ladder removes one more piece of core's per-step "
                  "work; 'saves' is how much the median ratio rose (negative: noise larger than the piece)."],
        "details": {},
    }

