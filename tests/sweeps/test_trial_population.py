"""run_population: members trained together are each a whole trial in its own run; a group the
population refuses as it sets up trains one by one in the same runs, each saying why."""
from __future__ import annotations

from torch import nn

from core.tasks.base import task
from core.tasks.diabetes import DiabetesTask
from sweeps.spec.load import spec_from_dict
from sweeps.tracking.base import RunHandle
from sweeps.trial import TrialSpec
from sweeps.trial_control import TrialControl
from sweeps.trial_population import TAG_PACK, layout_of, run_population
from tests.memory_tracker import MemoryTracker


class RunsTracker:
    """A MemoryTracker per run, so each member's params, points, tags and status stay apart."""

    def __init__(self) -> None:
        self.runs: dict[str, MemoryTracker] = {}

    def start_run(self, run, *, experiment=None, parent=None, tags=None):
        self.runs[str(run)] = MemoryTracker()
        return self.runs[str(run)].start_run(run, experiment=experiment, parent=parent, tags=tags)

    def __getattr__(self, name):
        def call(run, *args, **kwargs):
            return getattr(self.runs[run.run_id], name)(run, *args, **kwargs)
        return call

    def store_run_id(self, run_id):
        return run_id


class Flaky(nn.Module):
    """A model whose forward branches on a weight's value: vmap cannot run it, so it cannot be packed."""

    def __init__(self) -> None:
        super().__init__()
        self.net = DiabetesTask(width=8).build_model()

    def forward(self, x):
        return self.net(x) if float(self.net[0].weight.detach().sum()) > -1e9 else -self.net(x)


@task
class BranchingDiabetes(DiabetesTask):
    def build_model(self):
        return Flaky()


@task
class LayerNormDiabetes(DiabetesTask):
    """A layer the grouped model does not hold (core/fused_population.py): the members run under vmap."""

    def build_model(self):
        return nn.Sequential(nn.LayerNorm(10), super().build_model())


def _spec(target: str | None = None):
    task_section = {"target": target} if target else {"name": "diabetes", "model": "mlp"}
    return spec_from_dict({"name": "p", "task": {**task_section, "args": {"width": 8}},
                           "train": {"epochs": 2, "batch_size": 64, "num_workers": 0, "optimizer": "adamw"},
                           "search": {"lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
                           "objective": {"metric": "val_rmse", "direction": "minimize"},
                           "resources": {"pack": 3}})


def _run(spec, tmp_path):
    # Each member's notes in the order said, each with how many training steps its run had recorded then.
    tracker, notes = RunsTracker(), {}
    trials = [TrialSpec(n, {"lr": lr}, tmp_path / f"trial-{n:04d}", RunHandle("study", "0", "study"), "optuna",
                        owner=f"uid:trial-{n:04d}") for n, lr in enumerate([0.001, 0.01, 0.05])]

    def said(k: int, note: str) -> None:
        steps = [step for step, points in tracker.runs[f"trial-{k}"].metrics if "step/train_loss" in points]
        notes.setdefault(k, []).append((note, len(steps)))

    outcomes = run_population(spec, trials, [TrialControl() for _ in trials], tracker, on_pack=said)
    return tracker, notes, outcomes


def _texts(notes: dict) -> dict:
    return {k: [note for note, _ in said] for k, said in notes.items()}


def test_members_are_whole_trials_in_their_own_runs(tmp_path):
    tracker, points, outcomes = _run(_spec(), tmp_path)
    notes = _texts(points)
    assert [o.state for o in outcomes] == ["COMPLETE"] * 3
    # Said before training, then with how the members run (the diabetes MLP as one grouped model),
    # both before the first step.
    others = {0: "1, 2", 1: "0, 2", 2: "0, 1"}
    assert notes == {k: [f"packed with trials {o}", f"packed with trials {o} (grouped layers)"]
                     for k, o in others.items()}
    assert {k: [n for _, n in said_notes] for k, said_notes in points.items()} == {k: [0, 0] for k in others}
    assert [layout_of(said_notes[-1]) for said_notes in notes.values()] == ["grouped layers"] * 3
    assert layout_of(notes[0][0]) is None and layout_of("alone: (vmap)") is None
    for n, outcome in enumerate(outcomes):
        run = tracker.runs[f"trial-{n}"]
        assert run.status == "FINISHED" and run.tags[TAG_PACK] == notes[n][-1]
        assert run.params["lr"] == [0.001, 0.01, 0.05][n]
        epochs = [step for step, points in run.metrics if "val_rmse" in points]
        assert epochs == [1, 2]
        assert outcome.value == min(points["val_rmse"] for _, points in run.metrics if "val_rmse" in points)
        assert (tmp_path / f"trial-{n:04d}" / "best.pt").exists()
    assert len({o.value for o in outcomes}) == 3


def test_the_datasets_are_described_once_and_logged_to_every_members_run(tmp_path, monkeypatch):
    described = []
    real = DiabetesTask.describe_dataset
    monkeypatch.setattr(DiabetesTask, "describe_dataset",
                        lambda self, ds, split: described.append(split) or real(self, ds, split))
    tracker, _, outcomes = _run(_spec(), tmp_path)
    assert [o.state for o in outcomes] == ["COMPLETE"] * 3
    assert described == ["train", "val"]  # once for the population, not once per member
    inputs = [tracker.runs[f"trial-{n}"].tags["datasets"] for n in range(3)]
    assert [[d["context"] for d in logged] for logged in inputs] == [["training", "validation"]] * 3
    assert inputs[0] == inputs[1] == inputs[2]


def test_a_model_vmap_refuses_trains_its_members_one_by_one(tmp_path):
    tracker, points, outcomes = _run(_spec(f"{__name__}:BranchingDiabetes"), tmp_path)
    notes = _texts(points)
    assert [o.state for o in outcomes] == ["COMPLETE"] * 3
    for n in range(3):
        note = notes[n][-1]  # after "packed with trials ...", said before the probe refuses them
        assert note.startswith("alone: the model does not run under torch.func.vmap")
        assert tracker.runs[f"trial-{n}"].tags[TAG_PACK] == note


def test_members_the_grouped_model_cannot_hold_say_they_run_under_vmap(tmp_path):
    tracker, points, outcomes = _run(_spec(f"{__name__}:LayerNormDiabetes"), tmp_path)
    notes = _texts(points)
    assert [o.state for o in outcomes] == ["COMPLETE"] * 3
    assert notes[0] == ["packed with trials 1, 2", "packed with trials 1, 2 (vmap)"]
    assert tracker.runs["trial-0"].tags[TAG_PACK] == "packed with trials 1, 2 (vmap)"
