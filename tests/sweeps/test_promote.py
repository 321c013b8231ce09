"""`sweeps promote` on a real finished study: registry versions, aliases, lineage, the
registered model loaded back through pyfunc in another process (natural input in, class indices
out), its raw PyTorch module and the ONNX model in onnxruntime (model input in, logits out)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sweeps import cli
from tests.sweeps.study_fixtures import finished_study, in_study, weak_study  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _promote(study, *extra: str) -> int:
    return cli.main(["promote", str(study.spec), *extra])


def _versions(client, name: str) -> list:
    return list(client.search_model_versions(f"name = '{name}'"))


def _best_trial(study) -> tuple[int, object]:
    runs = study.trial_runs()
    number = max(runs, key=lambda n: (runs[n].data.metrics["objective"], -n))
    return number, runs[number]


def _validation_set() -> tuple[np.ndarray, np.ndarray]:
    """The validation images in natural units (raw pixels, 0 to 16) and as model inputs."""
    from core.tasks.digits import DigitsTask

    task = DigitsTask(model="mlp", width=32)
    _, val = task.datasets()
    natural = task.natural_examples(len(val)).numpy()
    return natural, torch.stack([val[i][0] for i in range(len(val))]).numpy()


def _trained_predictions(study, number: int, x: np.ndarray) -> list[int]:
    """The trial's own best checkpoint from its output folder, independent of promote."""
    from core.tasks.digits import DigitsTask

    model = DigitsTask(model="mlp", width=32).build_model()
    model.load_state_dict(torch.load(study.checkpoint(number), weights_only=True)["model"])
    model.eval()
    with torch.inference_mode():
        return model(torch.from_numpy(x)).argmax(1).tolist()


_LOAD_IN_ANOTHER_PROCESS = """
import json, os, sys
import mlflow, mlflow.pytorch, numpy as np, onnxruntime as ort, torch
uri = "models:/" + sys.argv[1]
natural, x = np.load(sys.argv[2]), np.load(sys.argv[3])
model = mlflow.pyfunc.load_model(uri)
predictions = np.asarray(model.predict(natural))
folder = mlflow.artifacts.download_artifacts(uri)
session = ort.InferenceSession(os.path.join(folder, "artifacts", "model.onnx"), providers=["CPUExecutionProvider"])
onnx_logits = session.run(None, {session.get_inputs()[0].name: x})[0]
report = json.load(open(os.path.join(folder, "artifacts", "onnx_parity.json")))
module = mlflow.pytorch.load_model(os.path.join(folder, "artifacts", "pytorch_model"))
with torch.inference_mode():
    module_logits = module(torch.from_numpy(x)).numpy()
print(json.dumps({"pyfunc": predictions.tolist(), "onnx": onnx_logits.argmax(1).tolist(),
                  "module": module_logits.argmax(1).tolist(), "shape": list(predictions.shape), "report": report}))
"""


def test_promote_registers_the_best_trial_loadable_by_alias_in_another_process(in_study, tmp_path, capsys, caplog):
    study = in_study
    client = study.client()
    number, run = _best_trial(study)

    assert _promote(study) == 0
    out = capsys.readouterr().out
    assert "ONNX re-verified" in out and f"{study.name}@champion -> version 1" in out
    assert not [r for r in caplog.records if "CloudPickle" in r.getMessage()]  # MLflow's notice, not ours to show

    mv = client.get_model_version_by_alias(study.name, "champion")
    assert mv.run_id == run.info.run_id
    tags = mv.tags
    assert tags["sweeps.study"] == study.name and tags["sweeps.trial_number"] == str(number)
    assert tags["sweeps.run_id"] == run.info.run_id and tags["sweeps.seed"] == "0"
    assert json.loads(tags["sweeps.params"]) == {"lr": pytest.approx(float(run.data.params["lr"]))}
    assert tags["sweeps.metric"] == "val_acc" and float(tags["sweeps.metric_value"]) == run.data.metrics["objective"]
    assert tags["sweeps.spec_hash"] == run.data.tags["sweeps.spec_hash"] and tags["sweeps.git_commit"]
    assert float(tags["sweeps.onnx_max_abs_diff"]) <= float(tags["sweeps.onnx_tolerance"])
    # the model was logged into the trial's own run
    assert mv.source.startswith("models:/m-")
    logged = client.get_logged_model(mv.source[len("models:/"):])
    assert logged.source_run_id == run.info.run_id and logged.name == f"trial-{number}-promoted"
    # the Models tab shows its val_acc and links it to the registered version
    assert {m.key: m.value for m in logged.metrics}["val_acc"] == run.data.metrics["objective"]
    assert json.loads(logged.tags["mlflow.modelVersions"]) == [{"name": study.name, "version": 1}]

    natural, x = _validation_set()
    np.save(tmp_path / "natural.npy", natural)
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "MLFLOW_TRACKING_URI": study.uri, "PYTHONPATH": str(ROOT),
           "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    proc = subprocess.run([sys.executable, "-c", _LOAD_IN_ANOTHER_PROCESS, f"{study.name}@champion",
                           str(tmp_path / "natural.npy"), str(tmp_path / "x.npy")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = _trained_predictions(study, number, x)
    assert got["shape"] == [len(x)]  # class indices, from the raw pixels
    assert got["pyfunc"] == expected
    assert got["onnx"] == expected  # the ONNX file and the raw module take model inputs
    assert got["module"] == expected
    assert got["report"]["passed"] is True and got["report"]["n_inputs_checked"] == min(256, len(x))

    # promoting again changes nothing: one version, one promoted model in the run beside the
    # trial's own checkpoint model (logged when the trial ended), which the version names
    assert _promote(study) == 0
    assert "already holds" in capsys.readouterr().out
    assert len(_versions(client, study.name)) == 1
    models = client.search_logged_models([run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run.info.run_id}'")
    assert sorted(m.name for m in models) == sorted([f"trial-{number}-promoted", f"trial-{number}"])
    assert tags["sweeps.checkpoint_model_id"] == run.data.tags["sweeps.model_id"] == next(
        m.model_id for m in models if m.name == f"trial-{number}")


def test_a_worse_candidate_is_refused_unless_forced(in_study, weak_study, capsys):
    client = in_study.client()
    name = "refusal_test"
    assert _promote(in_study, "--model-name", name) == 0
    holder = client.get_model_version_by_alias(name, "champion")
    capsys.readouterr()

    assert _promote(weak_study, "--model-name", name) == 1
    captured = capsys.readouterr()
    assert "refused to move refusal_test@champion" in captured.err and "--force" in captured.err
    assert "current holder" in captured.out  # the side-by-side table was shown first
    assert client.get_model_version_by_alias(name, "champion").version == holder.version
    assert len(_versions(client, name)) == 1

    assert _promote(weak_study, "--model-name", name, "--force") == 0
    now = client.get_model_version_by_alias(name, "champion")
    assert now.version != holder.version and now.tags["sweeps.study"] == weak_study.name
    assert now.tags["sweeps.onnx"] == "absent"  # the weak study exported no ONNX model


def test_a_crash_before_the_alias_moves_keeps_the_old_holder_and_the_next_promote_finishes(
        in_study, weak_study, monkeypatch):
    from mlflow.tracking import MlflowClient

    client = in_study.client()
    name = "crash_test"
    assert _promote(weak_study, "--model-name", name) == 0
    old = client.get_model_version_by_alias(name, "champion")

    def crash(self, *args, **kwargs):
        raise RuntimeError("simulated crash before the alias moved")

    with monkeypatch.context() as m:
        m.setattr(MlflowClient, "set_registered_model_alias", crash)
        m.setenv("SWEEPS_DEBUG", "1")  # the crash propagates (without it main's last resort returns 1)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _promote(in_study, "--model-name", name)
    assert client.get_model_version_by_alias(name, "champion").version == old.version
    assert len(_versions(client, name)) == 2  # the new version exists, without the alias

    assert _promote(in_study, "--model-name", name) == 0
    new = client.get_model_version_by_alias(name, "champion")
    assert new.version != old.version and new.run_id == _best_trial(in_study)[1].info.run_id
    assert len(_versions(client, name)) == 2  # reused, not registered again


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted((root / "runs").rglob("*")):
        if path.is_file() and ".mlflow_spool" not in path.parts:
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_dry_run_writes_nothing(in_study, capsys):
    from mlflow.exceptions import MlflowException

    before = _snapshot(in_study.root)
    assert _promote(in_study, "--model-name", "dry_test", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "dry run, nothing written" in out and "move alias 'champion'" in out
    assert _snapshot(in_study.root) == before
    with pytest.raises(MlflowException):
        in_study.client().get_registered_model("dry_test")


def test_metric_option_and_refused_names(in_study, capsys):
    from sweeps.errors import UsageError
    from sweeps.registry import metric_direction
    from sweeps.spec.load import load_spec

    spec = load_spec(in_study.spec)
    assert metric_direction("val_acc", spec) == "maximize"
    assert metric_direction("val_loss", spec) == "minimize"
    with pytest.raises(UsageError, match="would pick the worst trial; use --maximize val_acc"):
        metric_direction("val_acc", spec, "minimize")  # --minimize val_acc: the worst model
    with pytest.raises(UsageError, match="use --minimize val_loss"):
        metric_direction("val_loss", spec, "maximize")
    assert metric_direction("my_score", spec, "minimize") == "minimize"  # a metric of unknown sense: as asked
    # not the objective: the task's declared direction, not a guess from the name
    diabetes = spec.model_copy(update={"task": spec.task.model_copy(update={"name": "diabetes", "model": "mlp",
                                                                               "args": {}})})
    assert metric_direction("val_mae", diabetes) == "minimize" and metric_direction("samples_per_s", spec) == "maximize"

    runs = in_study.trial_runs()
    lowest_loss = min(runs, key=lambda n: min(m.value for m in in_study.client().get_metric_history(
        runs[n].info.run_id, "val_loss")))
    assert _promote(in_study, "--model-name", "by_loss", "--metric", "val_loss", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "val_loss (minimize)" in out and runs[lowest_loss].info.run_id in out

    assert _promote(in_study, "--model-name", "../escape") == 2
    assert "model name" in capsys.readouterr().err
