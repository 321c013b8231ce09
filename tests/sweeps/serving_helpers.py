"""Check the registered model the way a user calls it: the README's own lines, in a fresh process.

Generic over tasks: a task's test runs a small study named after the README snippet's model
(``promoted_study``), then ``readme_predictions(snippet, folder, inputs)`` runs the snippet's lines
exactly as the README has them, in a new Python process whose working directory is the study's
folder and whose environment has no ``MLFLOW_*`` variable, followed by
``predictions = model.predict(inputs)``; the test judges the predictions (accuracy, error, ...).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.sweeps.study_helpers import save_spec

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# Appended to the README's lines: the snippet must leave the loaded model in `model`.
_PREDICT = """
import sys as _sys
import numpy as _np
_np.save(_sys.argv[2], _np.asarray(model.predict(_np.load(_sys.argv[1], allow_pickle=False))))
"""


def readme_snippet(name: str) -> str:
    """The python block under ``<!-- snippet: NAME ... -->`` in README.md, exactly as written."""
    text = README.read_text()
    match = re.search(r"<!-- snippet: " + re.escape(name) + r"\b[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no python block marked <!-- snippet: {name} -->"
    return match.group(1)


def promoted_study(root: Path, spec: dict) -> Path:
    """Run ``spec`` with ``sweeps run`` in ``root`` (runs/ lands there), then ``sweeps promote``
    it; returns the spec file. In this process, like the other study tests (tests/sweeps/study_fixtures.py)."""
    from sweeps import cli

    path = save_spec(root, spec)
    before = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["run", str(path), "--quiet"]) == 0, f"study {spec['name']} did not finish"
        assert cli.main(["promote", str(path)]) == 0, f"study {spec['name']} was not promoted"
    finally:
        os.chdir(before)
    return path


def readme_predictions(snippet: str, folder: Path, inputs: np.ndarray, scratch: Path) -> tuple[np.ndarray, str]:
    """``model.predict(inputs)`` after the README snippet's lines, in a fresh process started in
    ``folder`` (nothing else set up: no MLFLOW_* variable; PYTHONPATH only names this checkout, as
    an installed project would be found). Returns (predictions, the process's stdout). Asserts the
    process left ``folder``'s top level as it was (no stray ``mlflow.db`` or ``mlruns``)."""
    scratch.mkdir(parents=True, exist_ok=True)
    x_path, out_path = scratch / "inputs.npy", scratch / "predictions.npy"
    np.save(x_path, inputs, allow_pickle=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(ROOT)
    before = sorted(p.name for p in folder.iterdir())
    proc = subprocess.run([sys.executable, "-c", readme_snippet(snippet) + _PREDICT, str(x_path), str(out_path)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (folder / "mlflow.db").exists(), "the README's lines left a stray ./mlflow.db"
    assert sorted(p.name for p in folder.iterdir()) == before, "the README's lines created files in the folder"
    return np.load(out_path, allow_pickle=False), proc.stdout
