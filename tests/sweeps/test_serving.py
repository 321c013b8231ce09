"""The registered model users call with natural input (issue 24): ``sweeps.serving`` on its own, and
the README's lines loading ``models:/lr_bs@champion`` in a fresh process after a real study."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.onnx_export import read_metadata, set_metadata
from core.tasks.digits import DigitsTask
from core.tasks.imagefolder import ImageFolderTask
from sweeps import serving
from sweeps.model_logging import signature_of
from tests.sweeps.serving_helpers import promoted_study, readme_predictions
from tests.sweeps.study_helpers import tiny_spec


def _digits_val(task: DigitsTask) -> tuple[torch.Tensor, torch.Tensor]:
    _, val = task.datasets()
    return torch.stack([val[i][0] for i in range(len(val))]), torch.tensor([val[i][1] for i in range(len(val))])


def test_predict_applies_preprocess_model_and_postprocess():
    task = DigitsTask(model="mlp", width=16)
    torch.manual_seed(0)
    model = task.build_model().eval()
    x, _ = _digits_val(task)
    natural = task.natural_examples(1000).numpy()
    with torch.inference_mode():
        expected = model(x).argmax(1).numpy()
    got = serving.predict(task, model, natural)
    assert got.dtype == np.int64 and got.shape == (len(x),)
    np.testing.assert_array_equal(got, expected)
    # (N, 64) rows, integers and a list give the same; model inputs when the model is not natural
    np.testing.assert_array_equal(serving.predict(task, model, natural.reshape(-1, 64).astype(np.int64)), expected)
    np.testing.assert_array_equal(serving.predict(task, model, list(natural[:3])), expected[:3])
    np.testing.assert_array_equal(serving.predict(task, model, x.numpy(), natural=False), expected)
    with pytest.raises(ValueError, match="at least one input"):
        serving.predict(task, model, natural[:0])


def test_signature_gives_the_outputs_and_leaves_the_input_to_the_tasks_contract(tmp_path):
    task = DigitsTask(model="mlp")
    example = task.natural_examples(8).numpy()
    sig = signature_of(example, np.zeros(8, dtype=np.int64))
    assert sig.inputs is None  # one dtype only in an MLflow schema: the task's InputSpec checks instead
    assert sig.outputs.inputs[0].shape == (-1,) and sig.outputs.inputs[0].type == np.dtype("int64")
    assert ImageFolderTask(root=str(tmp_path), image_size=32).natural_input.shapes == ((-1, -1, 3),)


def test_contract_and_description_say_the_input_in_one_sentence():
    task = DigitsTask()
    text = serving.contract(task, natural=True)
    assert text == f"takes {task.input_contract}." and text.count(". ") == 0
    described = serving.description({"sweeps.input_contract": text, "sweeps.onnx": "artifacts/model.onnx"}, 3, "s")
    assert described.startswith(f"The model takes {task.input_contract}. Trial 3 of study s.")
    assert "preprocessing and postprocessing are not included" in described
    assert "not natural input" in serving.contract(task, natural=False)


def test_onnx_metadata_says_preprocessing_is_not_inside(tmp_path):
    from core.onnx_export import export_and_verify

    task = DigitsTask(model="mlp", width=8)
    torch.manual_seed(0)
    model = task.build_model().eval()
    x, _ = _digits_val(task)
    path = tmp_path / "model.onnx"
    export_and_verify(model, x[:16], path, latency_runs=1)
    before = path.read_bytes()
    set_metadata(path, serving.onnx_metadata(task, {"name": "digits", "model": "mlp", "args": {"width": 8}}))
    meta = read_metadata(path)
    assert meta["sweeps.preprocessing"].startswith("not included: input 'input' is the model input of task 'digits'")
    assert "core.tasks.digits.DigitsTask.preprocess" in meta["sweeps.preprocessing"]
    assert meta["sweeps.postprocessing"].startswith("not included")
    assert json.loads(meta["sweeps.task"])["model"] == "mlp"
    set_metadata(path, {"sweeps.preprocessing": "again"})  # replaces, keeps the others
    assert read_metadata(path)["sweeps.preprocessing"] == "again" and "sweeps.task" in read_metadata(path)
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        ref = model(x[:16]).numpy()
    np.testing.assert_allclose(session.run(None, {"input": x[:16].numpy()})[0], ref, atol=1e-5)
    assert path.read_bytes() != before


# The digits study the README's snippet loads (models:/lr_bs@champion): one trial of the CNN,
# long enough to classify the validation images at about 97%.
DIGITS_CHAMPION = tiny_spec(
    "lr_bs", description="issue 24: the README's champion, loaded with natural input",
    task={"name": "digits", "model": "cnn", "args": {"val_fraction": 0.2}},
    train={"epochs": 8, "batch_size": 32, "momentum": 0.9, "scheduler": "onecycle", "export_onnx": True},
    search={"lr": {"type": "float", "low": 0.05, "high": 0.1, "log": True}},
    budget={"n_trials": 1, "max_failures": 1})


@pytest.mark.slow
def test_the_readme_lines_load_the_champion_and_predict_natural_digits(tmp_path, capsys):
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    root = tmp_path / "repo"
    promoted_study(root, DIGITS_CHAMPION)
    printed = capsys.readouterr().out
    assert "mlflow.set_tracking_uri(" in printed and DigitsTask.input_contract in printed

    digits = load_digits()
    _, val = train_test_split(np.arange(len(digits.target)), test_size=0.2, random_state=0, stratify=digits.target)
    predictions, stdout = readme_predictions("load-champion", root, digits.images, tmp_path / "scratch")
    assert predictions.shape == (len(digits.target),)
    val_acc = float((predictions[val] == digits.target[val]).mean())
    full_acc = float((predictions == digits.target).mean())
    assert val_acc >= 0.95 and full_acc >= 0.95, (val_acc, full_acc)
    assert stdout.strip().splitlines()[-1] == "[0 1 2 3 4]"  # what the README says its lines print

    # what the registry says about the input: description, signature, input example, tags, ONNX metadata
    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    mv = client.get_model_version_by_alias("lr_bs", "champion")
    assert mv.description.startswith(f"The model takes {DigitsTask.input_contract}.")
    assert mv.tags["sweeps.input"] == "natural" and mv.tags["sweeps.onnx_preprocessing"] == "not included"

    local = client.get_logged_model(mv.source[len("models:/"):]).artifact_location  # a folder under runs/
    meta = Model.load(local)
    assert meta.signature.inputs is None  # the task's input contract is checked by the model itself
    assert meta.signature.outputs.inputs[0].type == np.dtype("int64")
    example = meta.load_input_example(local)
    assert example.shape == (8, 8, 8) and example.min() >= 0 and example.max() <= 16
    assert read_metadata(f"{local}/artifacts/model.onnx")["sweeps.preprocessing"].startswith("not included")
