"""The user-task example of docs/STUDY_SPEC.md ("Your own task") is complete: its module, written
out as it stands in the page, declares a task that keeps the contract, trains with core.train to
a falling val_rmse, and its spec validates."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.test_docs import section

ROOT = Path(__file__).resolve().parents[1]


def _blocks(lang: str) -> list[str]:
    text = section((ROOT / "docs" / "STUDY_SPEC.md").read_text(encoding="utf-8"), "Your own task")
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


@pytest.fixture
def example(tmp_path, monkeypatch):
    """The example's module as ``mypkg.tasks`` in a fresh folder on sys.path."""
    [code] = _blocks("python")
    assert code.startswith("# mypkg/tasks.py\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tasks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mypkg", "mypkg.tasks"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_the_example_keeps_the_task_contract(example):
    from core.tasks.base import make_task

    task = make_task(target="mypkg.tasks:RoomTemperature", model="mlp", args={"width": 8})
    train, val = task.datasets()
    x_val = torch.stack([val[i][0] for i in range(len(val))])
    y_val = torch.stack([val[i][1] for i in range(len(val))])
    assert len(train) == 2000 and len(val) == 500 and x_val.shape == (500, 4)
    assert torch.equal(task.preprocess(task.natural_examples(500)), x_val)
    assert 15 <= float(y_val.min()) and float(y_val.max()) <= 30  # degrees: natural units
    output = task.build_model()(x_val)
    assert output.shape == (500, 1) and task.postprocess(output).shape == (500,)
    assert task.make_loss(None)(output, y_val).ndim == 0
    metrics = task.metrics()
    assert set(metrics) == {"rmse", "mae"} and not any(m.higher_is_better for m in metrics.values())
    perfect = ((y_val - 22.5) / 7.5).unsqueeze(1)
    metrics["rmse"].update(task.postprocess(perfect), y_val)
    assert float(metrics["rmse"].compute()) < 1e-4


def test_the_example_trains_and_its_spec_validates(example, tmp_path):
    from core.config import TrainConfig
    from core.train import train
    from sweeps.spec.load import load_spec

    task = __import__("mypkg.tasks", fromlist=["RoomTemperature"]).RoomTemperature(width=16)
    cfg = TrainConfig(epochs=4, batch_size=64, lr=0.01, optimizer="adamw", scheduler="constant", num_workers=0,
                      save_checkpoints=False, seed=0, monitor="val_rmse", monitor_mode="min")
    result = train(task, cfg)
    rmse = [epoch["val_rmse"] for epoch in result.history]
    assert rmse[-1] < rmse[0] and rmse[-1] < 3.0, rmse  # degrees; the spread of the targets is 4.3

    [spec_text] = _blocks("yaml")
    path = tmp_path / "room_temperature.yaml"
    path.write_text(spec_text)
    spec = load_spec(path)
    assert spec.objective.metric == "val_rmse" and spec.objective.direction == "minimize"


def test_a_classification_task_with_the_members_the_page_names_trains():
    """"A classification task gives only ..." names every member such a task needs: a task with
    exactly those (the rest left at Task's defaults) trains to a high val_acc."""
    from core.config import TrainConfig
    from core.tasks.base import Task
    from core.train import train
    from tests.sweeps.check_tasks import ThreeBlobs

    text = section((ROOT / "docs" / "STUDY_SPEC.md").read_text(encoding="utf-8"), "Your own task")
    [sentence] = re.findall(r"a classification task gives only (.*?);", " ".join(text.split()))
    members = re.findall(r"`(\w+)`", sentence)
    assert {"build_model", "datasets"} <= set(members)
    user_task = type("UserTask", (Task,), {m: ThreeBlobs.__dict__[m] for m in members})
    cfg = TrainConfig(epochs=3, batch_size=32, lr=0.05, optimizer="adamw", scheduler="constant", num_workers=0,
                      save_checkpoints=False, seed=0)
    result = train(user_task(), cfg)
    assert result.history[-1]["val_acc"] > 0.95, result.history


def test_a_classification_task_without_num_classes_fails_naming_it():
    from core.config import TrainConfig
    from core.tasks.base import TaskError
    from core.train import train
    from tests.sweeps.check_tasks import ThreeBlobsWithoutNumClasses

    cfg = TrainConfig(epochs=1, batch_size=32, num_workers=0, save_checkpoints=False)
    with pytest.raises(TaskError, match=r"task 'ThreeBlobsWithoutNumClasses' keeps the default metrics\(\) "
                                        r"\(accuracy over num_classes classes\) but its num_classes is 0: set "
                                        r"num_classes on the task"):
        train(ThreeBlobsWithoutNumClasses(), cfg)
