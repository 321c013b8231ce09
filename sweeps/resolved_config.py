"""A trial's resolved config: the ``config/resolved_config.json`` artifact every trial logs (the
full train config, the task section and the sampled params), read back from its run, and the
task and TrainConfig rebuilt from it.

``sweeps rerun`` trains the trial again from it; ``sweeps promote`` and the served model
(:mod:`sweeps.serving`) rebuild the trial's task from it, so a trial is rebuilt from what it
recorded, never from the spec as it is now."""
from __future__ import annotations

import json
import tempfile

from core.config import ConfigError, TrainConfig, apply_overrides
from core.tasks.base import Task, make_task
from sweeps.errors import RerunError
from sweeps.tracking import layout
from sweeps.tracking.reader import TrackingReader


def load_resolved_config(reader: TrackingReader, run_id: str) -> dict:
    """The trial's ``config/resolved_config.json`` artifact (written by ``sweeps.trial``)."""
    with tempfile.TemporaryDirectory(prefix="sweeps-config-") as tmp:
        try:
            path = reader.download_artifact(run_id, layout.ART_CONFIG, tmp)
        except Exception as exc:  # MlflowException or OSError, depending on the artifact store
            raise RerunError(f"run {run_id} has no {layout.ART_CONFIG} artifact ({str(exc).splitlines()[0]}); "
                             "only trials run by `sweeps run` can be rebuilt exactly") from exc
        return json.loads(path.read_text())


def task_from_resolved(resolved: dict) -> Task:
    """The trial's Task, from the resolved config's task section (name/target, model, args)."""
    section = resolved["task"]
    args = dict(section.get("args") or {})
    model = args.pop("model", section.get("model"))  # a searched model is one of the args
    return make_task(section.get("name"), target=section.get("target"), model=model, args=args)


def config_from_resolved(resolved: dict, run_id: str, seed: int | None = None) -> TrainConfig:
    """The trial's TrainConfig (``seed`` replaced when given)."""
    try:
        cfg = TrainConfig.from_dict(resolved["train"])
        return apply_overrides(cfg, {"seed": seed}) if seed is not None else cfg
    except (ConfigError, KeyError, TypeError) as exc:
        raise RerunError(f"the resolved config of run {run_id} does not fit this code version: {exc}") from exc
