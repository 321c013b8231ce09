"""The Ray driver while ``tuner.fit()`` runs: the live view, the parent run's best trial, and
``budget.max_failures`` (failed trials in a row stop the study, as under Optuna).

Ray pickles its callbacks into the experiment state, so :class:`DriverCallback` holds no
state of its own: it reads the running driver's ``LIVE`` (empty when no driver runs).
"""
from __future__ import annotations

import logging
import time

from core import faults
from sweeps.backends import ray_records as rr
from sweeps.backends.base import StudyResult
from sweeps.backends.driver import failures_in_a_row
from sweeps.backends.ray_hang import recorded_hang
from sweeps.backends.ray_trainable import find_trial_run
from sweeps.errors import StoreGone
from sweeps.parent_run import reader_for, update_parent_best

log = logging.getLogger("sweeps")
# The running driver's view: spec, study, tracker, parent, view, history (trial id -> results),
# drawn (when the view was last drawn), ended (end states in the order trials ended),
# interrupts (sweeps.backends.ray_cluster.Interrupts: asked to stop the fit).
LIVE: dict = {}

try:
    from ray.tune import Callback as _Callback
except ImportError:  # pragma: no cover - ray is a dependency; keeps `import sweeps` light if absent
    _Callback = object  # type: ignore[misc,assignment]  # a plain base class without Ray


class DriverCallback(_Callback):
    """Keeps the live view and the parent run's best trial current, and stops the fit after
    ``budget.max_failures`` failed trials in a row, or once the MLflow store has been away past
    its wait (the trials' writes wait in this machine's spool, which the driver's tracker watches)."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if not LIVE:
            return
        try:
            LIVE["tracker"].check_outage()
        except StoreGone as exc:
            LIVE["interrupts"].store_gone(exc)
        if result.get("epoch"):
            LIVE["history"].setdefault(trial.trial_id, []).append(result)
            if not result.get("sweeps_done"):
                faults.trial_mid_way()
        if time.monotonic() - LIVE["drawn"] > 0.5:
            LIVE["drawn"] = time.monotonic()
            LIVE["view"].update_result(self._result(trials))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finished(trials, trial, "TERMINATED")
        faults.signal_here(faults.Fault.DRIVER_KILL_AFTER_TRIAL)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finished(trials, trial, "ERROR")

    def on_trial_recover(self, iteration, trials, trial, **info):
        if not LIVE:
            return
        number, hung = rr.trial_number(trial), _recorded_hang(trial)
        if hung:  # budget.trial_timeout's watchdog killed its actor: Ray's retry fails at once with this
            line = f"trial {number} failed: {hung}; it is not resumed into the same hang"
        else:
            line = (f"trial {number} failed ({rr.error_reason(trial) or 'see its error.txt'}); retry "
                    f"{trial.num_failures} of {LIVE['spec'].budget.max_failures} from its last checkpoint")
        LIVE["view"].console.print(line, markup=False, highlight=False)

    def _finished(self, trials, trial, status) -> None:
        if not LIVE:
            return
        result = self._result(trials, {trial.trial_id: status})
        record = next((t for t in result.trials if t.number == rr.trial_number(trial)), None)
        if record is not None and record.state in ("COMPLETE", "PRUNED", "FAIL"):
            LIVE["ended"].append(record.state)
        try:
            update_parent_best(LIVE["tracker"], LIVE["parent"], result)
        except Exception as exc:  # noqa: BLE001 - the summary at the end writes it again
            log.warning("could not update the study's parent run: %s", exc)
        LIVE["view"].update_result(result)
        limit = LIVE["spec"].budget.max_failures
        if failures_in_a_row(LIVE["ended"]) >= limit:
            LIVE["interrupts"].stop("max_failures")

    @staticmethod
    def _result(trials, status: dict | None = None) -> StudyResult:
        spec = LIVE["spec"]
        records = []
        for t in trials:
            rows = LIVE["history"].get(t.trial_id, [])
            records.append(rr.record_of(StatusView(t, (status or {}).get(t.trial_id)), spec, rows, live=True))
        return rr.study_result(spec, LIVE["study"], records, LIVE["parent"].run_id)


class StatusView:
    """A live Ray trial with its status as the callback knows it (Ray sets it just after)."""

    def __init__(self, trial, status: str | None) -> None:
        self._trial, self.status = trial, status or trial.status

    def __getattr__(self, name):
        return getattr(self._trial, name)


def _recorded_hang(trial) -> str:
    """The reason the hang watchdog wrote on the trial's run before it killed the actor (Ray then
    reports only that the actor died); "" when it did not hang or the store cannot say. Asked only
    where a watchdog runs (budget.trial_timeout set): a store in an outage is not waited on otherwise."""
    parent = LIVE["parent"]
    if not LIVE["spec"].trial_timeout_seconds():
        return ""
    try:
        reader = reader_for(LIVE["spec"])
        run = find_trial_run(reader, parent, trial.trial_id)
        return recorded_hang(reader, run.run_id) if run is not None else ""
    except Exception:  # noqa: BLE001 - only the wording of a live line depends on it: Ray's reason is shown instead
        return ""
