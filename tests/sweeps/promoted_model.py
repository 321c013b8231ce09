"""A trial run in a real local MLflow store, as ``sweeps run`` leaves one, without a study: a digits
model trained in this process by ``core.train``, its best checkpoint, resolved config and ONNX
files logged as the run's artifacts. ``promote_logged`` then logs the registered pyfunc model the
way ``sweeps promote`` does (``sweeps.model_logging.log_model``), for tests that load it with
``mlflow.pyfunc`` or break one of its artifacts first."""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from core.config import TrainConfig
from core.tasks.digits import DigitsTask
from core.train import train
from sweeps.compare import open_client
from sweeps.registry import Candidate
from sweeps.tracking.reader import TrackingReader
from tests.sweeps.study_helpers import migrated_store

TASK_SECTION = {"name": "digits", "model": "mlp", "args": {"width": 16}}


@dataclass
class TrialFiles:
    """The files one trained trial wrote (its output folder)."""

    folder: Path
    cfg: TrainConfig


_TRAINED: dict[str, TrialFiles] = {}


def trained_digits(tmp_path_factory) -> TrialFiles:
    """:func:`train_digits` once per test process, shared by the modules that read its files
    (none writes into its folder)."""
    if "digits" not in _TRAINED:
        _TRAINED["digits"] = train_digits(tmp_path_factory.mktemp("trial"))
    return _TRAINED["digits"]


def train_digits(folder: Path) -> TrialFiles:
    """Two epochs of the digits MLP on CPU with the ONNX export: what a trial leaves in its folder."""
    cfg = TrainConfig(epochs=2, batch_size=64, lr=0.05, momentum=0.9, device="cpu", num_workers=0,
                      export_onnx=True, seed=0)
    result = train(DigitsTask(model="mlp", width=16), cfg, out_dir=folder)
    assert result.status == "completed" and (folder / "model.onnx").is_file(), result.reason
    return TrialFiles(folder, cfg)


def trial_run(root: Path, files: TrialFiles, onnx: bytes | None = None) -> tuple[str, TrackingReader, Candidate]:
    """A trial run in the SQLite store under ``root`` holding ``files`` as ``sweeps run`` logs them;
    ``onnx``: other bytes in place of its ``onnx/model.onnx``. Returns (store URI, reader, candidate)."""
    from mlflow.tracking import MlflowClient

    uri = migrated_store(root) if not (root / "mlflow.db").exists() else f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    names = {e.name for e in client.search_experiments()}
    exp = client.get_experiment_by_name("promote-inputs").experiment_id if "promote-inputs" in names else \
        client.create_experiment("promote-inputs", artifact_location=(root / "artifacts").as_uri())
    run = client.create_run(exp, run_name="trial-0")
    staged = root / "staged" / run.info.run_id
    staged.mkdir(parents=True)
    (staged / "resolved_config.json").write_text(json.dumps({"task": TASK_SECTION, "train": files.cfg.to_dict()}))
    client.log_artifact(run.info.run_id, str(staged / "resolved_config.json"), "config")
    client.log_artifact(run.info.run_id, str(files.folder / "best.pt"), "checkpoints")
    model_onnx = files.folder / "model.onnx"
    if onnx is not None:
        model_onnx = staged / "model.onnx"
        model_onnx.write_bytes(onnx)
    client.log_artifact(run.info.run_id, str(model_onnx), "onnx")
    client.log_artifact(run.info.run_id, str(files.folder / "onnx_parity.json"), "onnx")
    client.set_terminated(run.info.run_id)
    reader = open_client(uri)
    return uri, reader, Candidate(0, run.info.run_id, {}, 0.9, reader.get_run(run.info.run_id))


def promote_logged(uri: str, reader: TrackingReader, cand: Candidate) -> tuple[str, str]:
    """Log the candidate's registered pyfunc model as ``sweeps promote`` does; (model URI, what it printed)."""
    from sweeps.model_logging import log_model

    out = io.StringIO()
    model_uri, _, _ = log_model(reader, uri, None, cand, Console(file=out, width=300))
    return model_uri, out.getvalue()
