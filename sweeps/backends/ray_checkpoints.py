"""A Ray trial's checkpoints: the trial folder's ``last.pt`` and ``best.pt`` (core's own
checkpoints) plus a small metadata file, reported to Ray each epoch and put back into
the folder when Ray restarts the trial (retry, pause, restored driver, PBT exploit).

PBT: when the trial's ``lr``/``momentum`` differ from those the checkpoint was trained
with, the saved optimizer and scheduler state are rescaled (``lr``) and set (``momentum``)
before ``core.train`` resumes from it, so the trial continues at the new values.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sweeps.backends.ray_adapter import training_result

CKPT_META = "sweeps_checkpoint.json"
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_lrs", "_last_lr", "eta_min")


def report_with_checkpoint(metrics: dict, out_dir: Path, trial_id: str, number: int, params: dict,
                           final: bool = False) -> None:
    """``tune.report`` with a checkpoint of the trial folder's ``last.pt`` (+ ``best.pt``).
    ``final``: the trial has finished; the checkpoint keeps its final report, so a trial
    restored after a driver crash reports it again instead of running again.

    Ray copies the folder into the experiment storage before ``report`` returns, so the
    staging folder is removed right after (also when ``report`` raises ``SystemExit``)."""
    from ray import tune

    from core import checkpoint as ckpt  # lazy: the Ray driver loads no torch

    if not (out_dir / ckpt.LAST).exists():
        tune.report(metrics)  # diverged in its first epoch: nothing to keep
        return
    staging = Path(tempfile.mkdtemp(prefix=".ray-ckpt-", dir=out_dir))
    try:
        for name in (ckpt.LAST, ckpt.BEST):
            if (out_dir / name).exists():
                _link_or_copy(out_dir / name, staging / name)
        meta = {"trial_id": trial_id, "number": number, "params": params, "epoch": metrics.get("epoch"),
                "final": metrics if final else None}
        (staging / CKPT_META).write_text(json.dumps(meta))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(staging)))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # the files are replaced (never rewritten in place), so a link is safe
    except OSError:
        shutil.copy2(src, dst)


def clear_checkpoints(out_dir: Path) -> None:
    from core import checkpoint as ckpt  # lazy: the Ray driver loads no torch

    for name in (ckpt.LAST, ckpt.PREV, ckpt.BEST, ckpt.BEST_PREV):
        (out_dir / name).unlink(missing_ok=True)
    ckpt.remove_leftovers(out_dir)


def restore_checkpoint(folder: Path, out_dir: Path, params: dict) -> dict | None:
    """Put a Ray checkpoint back into the trial folder; returns its metadata.

    The checkpoint may come from another trial (PBT exploit) or another node. When the
    trial's ``lr``/``momentum`` differ from those the checkpoint was trained with (PBT
    explore), the saved optimizer and scheduler state are rescaled to the new values."""
    from core import checkpoint as ckpt  # lazy: the Ray driver loads no torch

    out_dir.mkdir(parents=True, exist_ok=True)
    clear_checkpoints(out_dir)
    for name in (ckpt.LAST, ckpt.BEST):
        if (folder / name).exists():
            shutil.copy2(folder / name, out_dir / name)
    meta_path = folder / CKPT_META
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is not None and (out_dir / ckpt.LAST).exists():
        apply_new_hyperparams(out_dir / ckpt.LAST, meta.get("params") or {}, params)
    return meta


def apply_new_hyperparams(path: Path, old: dict, new: dict) -> bool:
    """Rescale the learning rates in a ``last.pt`` by ``new lr / old lr`` and set the new
    momentum. Returns True when the file changed."""
    from core import checkpoint as ckpt  # lazy: the Ray driver loads no torch

    ratio = new["lr"] / old["lr"] if "lr" in new and "lr" in old and old["lr"] and new["lr"] != old["lr"] else None
    momentum = new.get("momentum") if "momentum" in new and new.get("momentum") != old.get("momentum") else None
    if ratio is None and momentum is None:
        return False
    state = ckpt.load_checkpoint(path)
    for group in state["optimizer"]["param_groups"]:
        if ratio is not None:
            _scale_lrs(group, ratio)
        if momentum is not None and "momentum" in group:
            group["momentum"] = momentum
    if ratio is not None:
        _scale_lrs(state["scheduler"], ratio)
    cfg = json.loads(state.get("config_json") or "{}")
    cfg.update({k: new[k] for k in ("lr", "momentum") if k in new})
    state["config_json"] = json.dumps(cfg)
    ckpt.save_checkpoint(state, path)
    return True


def _scale_lrs(obj: Any, ratio: float) -> None:
    """Multiply every learning-rate entry of an optimizer group or a (nested) scheduler state."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in _LR_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                obj[key] = value * ratio
            elif key in _LR_KEYS and isinstance(value, list):
                obj[key] = [v * ratio if isinstance(v, (int, float)) else v for v in value]
            elif isinstance(value, (dict, list)):
                _scale_lrs(value, ratio)
    elif isinstance(obj, list):
        for item in obj:
            _scale_lrs(item, ratio)


def existing_checkpoint(checkpoint_result):
    """``checkpoint_result`` (what Ray restores a trial from) if its folder exists, else the
    newest checkpoint of the same trial that does (None of them: unchanged, Ray reports it)."""
    from ray.tune import Checkpoint

    checkpoint = getattr(checkpoint_result, "checkpoint", None)
    if checkpoint is None or checkpoint.filesystem.type_name != "local" or Path(checkpoint.path).exists():
        return checkpoint_result
    folder = Path(checkpoint.path).parent
    found = sorted(p for p in folder.glob("checkpoint_*") if p.is_dir() and (p / CKPT_META).exists())
    if not found:
        return checkpoint_result
    meta = json.loads((found[-1] / CKPT_META).read_text())
    metrics = {"training_iteration": meta.get("epoch") or 0}
    return training_result(Checkpoint.from_directory(str(found[-1])), metrics)

