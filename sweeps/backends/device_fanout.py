"""``sweeps worker SPEC --devices ... --gpus-per-trial K``: one machine's share of a study, fanned out.

The same plan as ``sweeps run`` (:func:`~sweeps.backends.optuna_backend.plan_local_workers`
over the devices) and the same :class:`~sweeps.backends.supervisor.Supervisor`: one worker
process per slot, pinned with ``CUDA_VISIBLE_DEVICES``, one trial at a time each, replaced when
it dies, asked to checkpoint and stop on SIGTERM / SIGINT (its trial is requeued). Unlike
``sweeps run`` it creates nothing: it joins the study ``sweeps run`` created (waiting for it as
a single worker does) and hands each worker that study's identity and MLflow parent run.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from sweeps.backends import optuna_attrs
from sweeps.backends.optuna_backend import plan_local_workers, workers_beat_dir
from sweeps.backends.optuna_study import check_tracking_before_trials, join_study
from sweeps.backends.optuna_worker import EXIT_MAX_FAILURES
from sweeps.backends.supervisor import Supervisor
from sweeps.backends.worker_protocol import WorkerGo
from sweeps.errors import ResourcesError, UsageError
from sweeps.parent_run import reader_for, tracker_for
from sweeps.slot_plan import WorkerSlot
from sweeps.spec.model import ResourcesSection, StudySpec
from sweeps.stop_signals import STOP_SIGNALS, after_hangup

log = logging.getLogger("sweeps")
# The flags and the spec fields they override: messages about the field name the flag given.
FLAG_OF_FIELD = {"devices": "--devices", "gpus_per_trial": "--gpus-per-trial"}


def parse_devices_flag(text: str) -> str | list[int]:
    """``--devices``: ``auto``, ``cpu`` or comma-separated device ids such as ``0,1,2,3``."""
    value = text.strip()
    if value in ("auto", "cpu"):
        return value
    tokens = [t.strip() for t in value.split(",")]
    if not value or not all(t.isdigit() for t in tokens):
        raise UsageError(f"--devices {text!r}: write auto (every GPU this machine shows), cpu, or "
                         "comma-separated GPU ids such as --devices 0,1,2,3")
    ids = [int(t) for t in tokens]
    if len(set(ids)) != len(ids):
        raise UsageError(f"--devices {text!r} names a device more than once; list each id once, e.g. --devices 0,1")
    return ids


def with_resources(spec: StudySpec, overrides: dict) -> StudySpec:
    """``spec`` with its ``resources`` fields replaced by ``overrides`` (the flags), checked by
    the spec's own rules; a refusal names the flag, not the spec field."""
    try:
        resources = ResourcesSection.model_validate({**spec.resources.model_dump(), **overrides})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            flag = FLAG_OF_FIELD.get(field, f"resources.{field}")
            problems.append(f"{flag} {overrides.get(field)!r}: {err['msg'].removeprefix('Value error, ')}")
        raise UsageError("; ".join(problems)) from None
    return spec.model_copy(update={"resources": resources})


def plan_for_flags(spec: StudySpec, overrides: dict) -> list[WorkerSlot]:
    """The slots ``sweeps run`` would plan with the flags as the spec's resources; a resources
    error names the flags given in place of the spec fields they override."""
    try:
        return plan_local_workers(spec)
    except ResourcesError as exc:
        text = str(exc)
        for field, flag in FLAG_OF_FIELD.items():
            if field in overrides:
                text = text.replace(f"resources.{field}", flag)
        raise ResourcesError(text) from None


def run_worker_pool(spec: StudySpec, overrides: dict, wait_s: float) -> int:
    """Join the study, run one worker per planned slot until the budget is taken; the exit
    code: 0 when it is, 3 for budget.max_failures, 128 + N when signal N stopped it."""
    # As many workers as fit on the devices given: resources.workers is the count of the machine
    # that runs `sweeps run`, not of every machine that joins it.
    spec = with_resources(spec, {**overrides, "workers": "auto"})
    slots = plan_for_flags(spec, overrides)  # before any wait: a wrong flag fails at once
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame) -> None:  # while waiting for the study: no worker to stop yet
        after_hangup(signum)
        received.append(signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        study = join_study(spec, wait_s, stop)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if study is None:
        return 128 + received[0]
    tracker = tracker_for(spec)  # its check_outage stops the workers as on SIGTERM once the store is away too long
    check_tracking_before_trials(tracker, spec.experiment_name())
    uid = study.user_attrs[optuna_attrs.ATTR_STUDY_UID]
    # Read once here, while the store answers (just checked): a worker restarted in an outage needs no read.
    parent = reader_for(spec).handle(study.user_attrs[optuna_attrs.ATTR_PARENT_RUN])
    since = time.time()

    def go_for(slot: WorkerSlot, beat: Path) -> WorkerGo:
        return WorkerGo(spec_text=spec.text or "", spec_path=str(spec.path), study_name=study.study_name,
                        study_uid=uid, parent_run_id=parent.run_id, parent_experiment_id=parent.experiment_id,
                        parent_run_name=parent.name, since=since, deadline=None, slot=slot.index,
                        threads=slot.threads, beat_file=str(beat), resources=overrides or None, pool=len(slots))

    log.warning("joining study %r with %d worker(s) on this machine: %s", study.study_name, len(slots),
                ", ".join(f"slot {s.index} on {_devices_text(s)}" for s in slots))
    supervisor = Supervisor(spec, study, go_for, workers_beat_dir(spec), since, None, on_progress=tracker.check_outage,
                            max_failures_code=EXIT_MAX_FAILURES)
    stopped, code = supervisor.run(slots)
    if stopped:
        log.warning("%s", stopped)
    return code


def _devices_text(slot: WorkerSlot) -> str:
    return f"GPUs {','.join(map(str, slot.devices))}" if slot.devices else f"CPU ({slot.threads} threads)"
