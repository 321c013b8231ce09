"""A population (core/population.py) trains each member as the member's run alone would: the same
per-step losses (1e-5 relative over the first epoch, fp32) and the same final objective (1e-4),
for every optimizer and schedule the loop supports, with BatchNorm and dropout in the model."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core import checkpoint as ckpt
from core.config import apply_overrides
from core.population import MemberRun, PackError
from core.reporting import Decision, RecordingReporter
from core.tasks.synthetic import SyntheticTask
from core.train import train, train_population
from tests.core.helpers import StopAt, fast_config

STEP_RTOL, FINAL_RTOL = 1e-5, 1e-4


class NormDropoutTask(SyntheticTask):
    """A small classifier with BatchNorm and dropout on synthetic features (no files, no torchmetrics)."""

    def __init__(self, width: int = 16, dropout: float = 0.3) -> None:
        super().__init__(model="mlp", shape=(12,), num_classes=3, n_train=96, n_val=40, width=width)
        self.dropout = dropout

    def build_model(self) -> nn.Module:
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam scales up to
        # lr-sized steps, so its value (and the running mean it moves) would follow the rounding
        # of whichever kernels ran, packed or alone (as between two thread counts).
        return nn.Sequential(nn.Linear(12, self.width, bias=False), nn.BatchNorm1d(self.width), nn.ReLU(),
                             nn.Dropout(self.dropout), nn.Linear(self.width, 3))


# Each member's own hyperparameters: what a sweep searches.
MEMBERS = [
    {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.9, "seed": 0},
    {"lr": 0.01, "weight_decay": 1e-3, "momentum": 0.5, "adam_beta1": 0.8, "grad_clip": 0.5, "seed": 0},
    {"lr": 0.2, "weight_decay": 1e-4, "momentum": 0.0, "adam_beta2": 0.99, "seed": 3},
]


def _configs(**shared) -> list:
    base = fast_config(epochs=3, batch_size=16, monitor="val_acc", monitor_mode="max", **shared)
    return [apply_overrides(base, member) for member in MEMBERS]


def _alone(task_factory, cfgs, **kwargs):
    reporters, results = [], []
    for cfg in cfgs:
        reporter = RecordingReporter()
        results.append(train(task_factory(), cfg, reporter, **kwargs))
        reporters.append(reporter)
    return reporters, results


def _packed(task_factory, cfgs, reporters=None):
    reporters = reporters or [RecordingReporter() for _ in cfgs]
    results = train_population(task_factory(), [MemberRun(cfg, r) for cfg, r in zip(cfgs, reporters, strict=True)])
    return reporters, results


def _assert_same_runs(alone, packed, cfgs) -> None:
    (a_reps, a_res), (p_reps, p_res) = alone, packed
    per_epoch = len(a_reps[0].steps) // cfgs[0].epochs
    for a_rep, p_rep, a, p in zip(a_reps, p_reps, a_res, p_res, strict=True):
        assert [s for s, _ in p_rep.steps] == [s for s, _ in a_rep.steps]
        for (_, a_m), (_, p_m) in zip(a_rep.steps[:per_epoch], p_rep.steps[:per_epoch], strict=True):
            assert p_m["train_loss"] == pytest.approx(a_m["train_loss"], rel=STEP_RTOL)
            assert p_m["lr"] == pytest.approx(a_m["lr"], rel=1e-12)
        assert p.status == a.status and p.epochs_completed == a.epochs_completed
        assert p.best_metric == pytest.approx(a.best_metric, rel=FINAL_RTOL)
        assert p.metrics["val_loss"] == pytest.approx(a.metrics["val_loss"], rel=FINAL_RTOL)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("scheduler", ["onecycle", "cosine", "step", "plateau", "constant"])
def test_members_train_as_alone(optimizer, scheduler):
    cfgs = _configs(optimizer=optimizer, scheduler=scheduler, warmup_epochs=0.5, step_size_epochs=1,
                    plateau_patience=0)
    alone = _alone(NormDropoutTask, cfgs)
    packed = _packed(NormDropoutTask, cfgs)
    _assert_same_runs(alone, packed, cfgs)
    # The members really differ: their own hyperparameters, not one run copied.
    finals = {round(r.metrics["train_loss"], 6) for r in packed[1]}
    assert len(finals) == len(cfgs)


def test_pruned_member_leaves_and_the_others_go_on():
    cfgs = _configs()
    reporters = [RecordingReporter(), RecordingReporter(prune_after_epoch=1), RecordingReporter()]
    _, results = _packed(NormDropoutTask, cfgs, reporters)
    assert [r.status for r in results] == ["completed", "pruned", "completed"]
    assert [len(r.history) for r in results] == [3, 1, 3]
    alone = _alone(NormDropoutTask, cfgs)
    for k in (0, 2):  # the others trained as if the pruned one had never been there
        assert results[k].best_metric == pytest.approx(alone[1][k].best_metric, rel=FINAL_RTOL)
        assert reporters[k].steps[-1][1]["train_loss"] == pytest.approx(
            alone[0][k].steps[-1][1]["train_loss"], rel=FINAL_RTOL)


def test_diverging_member_fails_alone(tmp_path):
    cfgs = _configs()
    cfgs[1] = apply_overrides(cfgs[1], {"lr": 1e12, "optimizer": "sgd", "grad_clip": None})
    reporters = [RecordingReporter() for _ in cfgs]
    results = train_population(NormDropoutTask(), [MemberRun(c, r, tmp_path / f"m{k}")
                                                   for k, (c, r) in enumerate(zip(cfgs, reporters, strict=True))])
    assert [r.status for r in results] == ["completed", "diverged", "completed"]
    assert (tmp_path / "m1" / "diverged.json").exists()
    alone = _alone(NormDropoutTask, [cfgs[0]])
    assert results[0].best_metric == pytest.approx(alone[1][0].best_metric, rel=FINAL_RTOL)
    assert all(math.isfinite(r.metrics["train_loss"]) for r in (results[0], results[2]))


def test_killed_population_resumes_from_members_checkpoints(tmp_path):
    cfgs = [apply_overrides(c, {"save_checkpoints": True}) for c in _configs(scheduler="onecycle")]
    outs = [tmp_path / f"m{k}" for k in range(len(cfgs))]
    straight = _alone(NormDropoutTask, cfgs)
    stopping = [StopAt(step=8) for _ in cfgs]  # mid-epoch 2 (6 steps an epoch)
    first = train_population(NormDropoutTask(), [MemberRun(c, r, o) for c, r, o in zip(cfgs, stopping, outs,
                                                                                      strict=True)])
    assert {r.status for r in first} == {"interrupted"}
    again = [RecordingReporter() for _ in cfgs]
    results = train_population(NormDropoutTask(), [MemberRun(c, r, o) for c, r, o in zip(cfgs, again, outs,
                                                                                        strict=True)], resume=True)
    for k, result in enumerate(results):
        assert result.status == "completed"
        assert result.best_metric == pytest.approx(straight[1][k].best_metric, rel=FINAL_RTOL)
        resumed = again[k].resumed_steps + again[k].steps
        assert [s for s, _ in resumed] == [s for s, _ in straight[0][k].steps]
        assert resumed[-1][1]["train_loss"] == pytest.approx(straight[0][k].steps[-1][1]["train_loss"], rel=FINAL_RTOL)
    # A member's checkpoint is a plain run's: it resumes alone too, holding only its own weights.
    state = torch.load(outs[0] / "last.pt", weights_only=True)
    assert state["model"]["0.weight"].untyped_storage().nbytes() == 16 * 12 * 4


def test_members_checkpoint_best_and_export_onnx(tmp_path):
    cfgs = [apply_overrides(c, {"save_checkpoints": True, "export_onnx": True}) for c in _configs()[:2]]
    results = train_population(NormDropoutTask(), [MemberRun(c, RecordingReporter(), tmp_path / f"m{k}")
                                                   for k, c in enumerate(cfgs)])
    for k, result in enumerate(results):
        assert result.checkpoint_best == tmp_path / f"m{k}" / "best.pt"
        assert result.onnx is not None and result.onnx.passed


def test_interrupt_stops_every_member():
    class Interrupting(RecordingReporter):
        def report_epoch(self, epoch, step, metrics):
            super().report_epoch(epoch, step, metrics)
            return Decision.INTERRUPT

    _, results = _packed(NormDropoutTask, _configs(), [Interrupting() for _ in MEMBERS])
    assert [r.status for r in results] == ["interrupted"] * 3
    assert [r.epochs_completed for r in results] == [1, 1, 1]


@pytest.mark.parametrize("change, reason", [
    ({"batch_size": 8}, "train.batch_size differs"),
    ({"mixup_alpha": 0.2}, "mixup"),
    ({"compile": True}, "compile"),
])
def test_what_cannot_be_packed_is_refused(change, reason):
    cfgs = _configs()
    cfgs[1] = apply_overrides(cfgs[1], change)
    with pytest.raises(PackError, match=reason):
        _packed(NormDropoutTask, cfgs)


def test_models_of_other_shapes_are_refused():
    widths = iter([16, 8, 16])

    class Varying(NormDropoutTask):
        def build_model(self):
            self.width = next(widths)
            return super().build_model()

    task = Varying()
    with pytest.raises(PackError, match="different parameter or buffer shapes"):
        train_population(task, [MemberRun(c) for c in _configs()])


def test_members_checkpointing_every_few_epochs_keep_each_ones_best_and_final_weights(tmp_path):
    """``checkpoint_every: 2`` of 3 epochs: each member writes at epochs 2 and 3 only, and its
    last.pt and best.pt hold what a population checkpointing every epoch holds."""
    every = {k: [apply_overrides(c, {"save_checkpoints": True, "checkpoint_every": k}) for c in _configs()]
             for k in (1, 2)}
    outs = {k: [tmp_path / f"every{k}" / f"m{i}" for i in range(len(cfgs))] for k, cfgs in every.items()}
    written = {}

    class Looks(RecordingReporter):
        """Notes, as each epoch is reported, which epoch the member's last.pt holds (0: none)."""

        def __init__(self, out):
            super().__init__()
            self.out = out

        def report_epoch(self, epoch, step, metrics):
            last = self.out / ckpt.LAST
            written[(self.out, epoch)] = ckpt.load_checkpoint(last)["epoch"] if last.exists() else 0
            return super().report_epoch(epoch, step, metrics)

    for k, cfgs in every.items():
        results = train_population(NormDropoutTask(), [MemberRun(c, Looks(o), o)
                                                       for c, o in zip(cfgs, outs[k], strict=True)])
        assert {r.status for r in results} == {"completed"}
    for one, two in zip(outs[1], outs[2], strict=True):
        assert [written[(two, e)] for e in (1, 2, 3)] == [0, 2, 3]
        assert [written[(one, e)] for e in (1, 2, 3)] == [1, 2, 3]
        for name in (ckpt.LAST, ckpt.BEST):
            a, b = ckpt.load_checkpoint(one / name), ckpt.load_checkpoint(two / name)
            assert a["model"].keys() == b["model"].keys()
            assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"]), (two, name)


class ConvTask(SyntheticTask):
    """Small CNNs on synthetic 8x8 images: a plain stack of layers (``kind`` "plain"), which the
    population runs as one model of grouped layers (core/fused_population.py); one whose forward
    concatenates two feature maps along the channels as a U-Net's skip does ("concat"), or one
    whose forward takes a softmax over the classes in evaluation only ("eval_softmax"), which it
    runs under ``vmap``. The batch norm comes first: a layer right before one is scale-free, and
    Adam turns its gradient's rounding (a plain convolution's alone, a grouped one's packed) into
    steps."""

    def __init__(self, kind: str = "plain") -> None:
        super().__init__(model="cnn", shape=(1, 8, 8), num_classes=3, n_train=96, n_val=40, width=8)
        self.kind = kind

    def build_model(self) -> nn.Module:
        head = [nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.3), nn.Linear(8 * 16, 3)]
        if self.kind == "concat":
            return _Skip(nn.Sequential(*head))
        plain = nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 8, 3, padding=1), *head)
        return _EvalSoftmax(plain) if self.kind == "eval_softmax" else plain


class _EvalSoftmax(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out if self.training else out.softmax(dim=1)


class _Skip(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.BatchNorm2d(1), nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 4, 1)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.head(torch.cat([self.a(x), self.b(x)], dim=1))


@pytest.mark.parametrize("kind, fused", [("plain", True), ("concat", False), ("eval_softmax", False)])
@pytest.mark.parametrize("optimizer, scheduler", [("sgd", "onecycle"), ("adamw", "cosine")])
def test_cnn_members_train_as_alone_as_one_grouped_model_or_under_vmap(monkeypatch, kind, fused, optimizer,
                                                                       scheduler):
    import core.population as population

    made = []
    pack = population.pack_models
    monkeypatch.setattr(population, "pack_models", lambda *args: made.append(pack(*args)) or made[-1])
    cfgs = _configs(optimizer=optimizer, scheduler=scheduler, warmup_epochs=0.5)
    alone = _alone(lambda: ConvTask(kind), cfgs)
    packed = _packed(lambda: ConvTask(kind), cfgs)
    assert [p.fused is not None for p in made] == [fused]
    _assert_same_runs(alone, packed, cfgs)


def test_the_shipped_small_models_run_as_one_grouped_model():
    from core.fused_population import FusedState, fused_model
    from core.tasks.base import make_task

    for name, model in (("digits", "cnn"), ("digits", "mlp"), ("diabetes", "mlp")):
        assert fused_model(make_task(name, model=model).build_model(), FusedState()) is not None, (name, model)
    # The U-Net upsamples (a layer the fused model does not have) and concatenates feature maps
    # in its own forward: vmap runs it.
    assert fused_model(make_task("shapes", model="unet").build_model(), FusedState()) is None
