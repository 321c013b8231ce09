"""The study-level LR range test: run once before the trials, logged to the parent run.

With ``lr_finder.narrow_search`` the ``lr`` search range becomes
``[suggestion / narrow_factor, suggestion * narrow_factor]`` intersected with the spec's
range, and is stored with the study, so every worker and every resume samples from the
same narrowed range. A suggestion outside the spec's range leaves the range unchanged and says so.
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import optuna

from core.lr_finder import lr_range_test
from sweeps.backends import optuna_study
from sweeps.spec.model import StudySpec
from sweeps.spec.search_space import CategoricalParam
from sweeps.tracking import layout
from sweeps.tracking.base import RunHandle
from sweeps.tracking.mlflow_tracker import MlflowTracker
from sweeps.trial import trial_config

log = logging.getLogger("sweeps")
ATTR_RESULT = "lr_finder"


def run_study_lr_finder(spec: StudySpec, study: optuna.Study, tracker: MlflowTracker, parent: RunHandle) -> dict:
    if ATTR_RESULT in study.user_attrs:  # ran when the study started; a resume keeps it
        return study.user_attrs[ATTR_RESULT]
    lf = spec.lr_finder
    params = {k: _midpoint(v) for k, v in spec.search.items()}  # the range test runs at mid-range settings
    params.pop("lr", None)
    cfg = trial_config(spec, params)
    result = lr_range_test(spec.make_task(params), cfg, start_lr=lf.start_lr, end_lr=lf.end_lr,
                           num_steps=lf.num_steps, rule=lf.rule)
    summary = {"suggestion": result.suggestion, "rule": result.rule, "suggestions": result.suggestions,
               "steps": result.steps, "epochs_cost": result.epochs_cost, "narrowed": None}
    if lf.narrow_search and "lr" in spec.search:
        p = spec.search["lr"]
        assert not isinstance(p, CategoricalParam)  # spec validation: narrow_search needs a float lr
        narrowed = lf.narrowed_range(result.suggestion, p.low, p.high)
        if narrowed is None:
            log.warning("lr_finder: suggestion %.3g is outside search.lr [%g, %g]; the range is kept",
                        result.suggestion, p.low, p.high)
        else:
            summary["narrowed"] = list(narrowed)
            study.set_user_attr(optuna_study.ATTR_LR_RANGE, list(narrowed))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lr_finder.json"
        path.write_text(json.dumps({**result.to_dict(), **summary}))
        tracker.log_artifact(parent, path, layout.ART_LR_FINDER_DIR)
    for i, (lr, loss) in enumerate(zip(result.lrs, result.smoothed, strict=True)):
        tracker.log_metrics(parent, {"lr_finder/lr": lr, "lr_finder/smoothed_loss": loss}, i)
    tracker.log_metrics(parent, {"lr_finder/suggestion": result.suggestion}, 0)
    tracker.flush(parent)  # the curve is on the parent run before the first trial starts
    study.set_user_attr(ATTR_RESULT, summary)
    return summary


def _midpoint(p):
    if p.type == "categorical":
        return p.choices[len(p.choices) // 2]
    if p.type == "int":
        return (p.low + p.high) // 2
    return (p.low * p.high) ** 0.5 if p.log else (p.low + p.high) / 2
