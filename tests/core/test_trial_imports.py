"""A digits trial's process loads what the trial uses and nothing else: not torchmetrics (nor the
torchvision models and SciPy signal module it pulls in), and not ONNX before an export. A fresh
interpreter that imports what `sweeps run`'s fork server imports before it forks a worker. (torch._dynamo
is loaded: any torch.optim optimizer imports it.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

UNUSED = ("torchmetrics", "torchvision", "scipy.signal", "onnx", "onnxruntime")
_TRIAL = """
import importlib, json, sys, tempfile
from sweeps.backends.optuna_worker import TRIAL_IMPORTS
from sweeps.backends.worker_forkserver import DRIVER_MAIN, WORKER_MODULE
for module in (WORKER_MODULE, *TRIAL_IMPORTS, *DRIVER_MAIN):
    importlib.import_module(module)
from core.config import TrainConfig
from core.reporting import RecordingReporter
from core.tasks.base import make_task
from core.train import train
reporter = RecordingReporter()
with tempfile.TemporaryDirectory() as out:
    train(make_task("digits", model="cnn", args={"width": 8}),
          TrainConfig.from_dict({"epochs": 1, "batch_size": 64, "lr": 0.05, "max_steps_per_epoch": 3}), reporter, out)
print(json.dumps({"val_acc": reporter.epochs[-1][1]["val_acc"],
                  "loaded": sorted(m for m in %r if m in sys.modules)}))
"""


@pytest.mark.slow  # a fresh interpreter imports torch and trains: seconds, more than the fast tier allows
def test_a_one_epoch_digits_trial_loads_no_module_it_does_not_use():
    proc = subprocess.run([sys.executable, "-c", _TRIAL % (UNUSED,)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [] and 0.0 <= got["val_acc"] <= 1.0

