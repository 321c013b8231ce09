"""What ``sweeps run`` tells a local Optuna worker: one typed message, serialized here only.

``sweeps run`` forks each worker from its fork server (``worker_forkserver``) and writes one JSON
line to its pipe; ``sweeps worker --devices`` starts each worker (``python -m
sweeps.backends.optuna_worker``) and writes the line to its stdin: :class:`WorkerGo`. It carries
the spec *snapshot* that ``sweeps run`` read and validated (a worker never reads the spec file
again, so an edit made while the study runs cannot split it), the study it works for, the study's MLflow run (its id,
experiment and name: a worker nests its trials' runs under it without reading the store, so one
started during an MLflow outage trains and spools like the others) and the slot it owns.
Only what a library reads before the worker can parse a message travels in the environment:
``CUDA_VISIBLE_DEVICES`` and the OpenMP/MKL thread counts (``slot_plan.WorkerSlot.env``); the
worker sizes the thread pools already loaded (a forked worker's) at its go.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from sweeps.tracking.base import RunHandle


@dataclass(frozen=True)
class WorkerGo:
    spec_text: str  # the spec file's text as ``sweeps run`` read and validated it
    spec_path: str  # where it was read from: for messages and commands shown to the user
    study_name: str  # the Optuna study (``name`` or ``name-vN`` after --fresh)
    study_uid: str  # the study's identity (trial folders and checkpoints carry it)
    parent_run_id: str  # the study's MLflow run
    parent_experiment_id: str  # its experiment, where the trials' runs go
    parent_run_name: str
    since: float  # this invocation's start (failures in a row count from here)
    deadline: float | None  # budget.timeout as a time.time() instant, or None
    slot: int  # the pool slot this worker owns
    threads: int  # torch intra-op threads
    beat_file: str  # touched about once a second while a trial makes progress
    # `sweeps worker --devices/--gpus-per-trial`: the resources fields its flags override (the
    # spec text stays the file's), so a trial holding K GPUs runs DDP over them as it would there.
    resources: dict | None = None
    pool: int = 1  # the workers this one was started with: resources.pack leaves each its share of the budget

    def parent(self) -> RunHandle:
        """The study's MLflow run, as the trials' runs nest under it."""
        return RunHandle(self.parent_run_id, self.parent_experiment_id, self.parent_run_name)

    def to_line(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_line(cls, line: str) -> WorkerGo:
        """Parse one line; raises ValueError naming what is missing or unexpected."""
        data = json.loads(line)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            raise ValueError(f"not a WorkerGo message: {line[:200]!r}")
        return cls(**data)
