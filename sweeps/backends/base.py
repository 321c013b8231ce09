"""The Backend interface and the read-only view of a study that every command shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

from sweeps.spec import StudySpec


@dataclass
class TrialRecord:
    number: int
    state: str  # COMPLETE | PRUNED | FAIL | RUNNING | WAITING
    params: dict
    value: float | None
    duration_s: float | None
    run_id: str | None  # the trial's MLflow run
    intermediate: dict[int, float] = field(default_factory=dict)  # epoch -> objective value
    reason: str = ""
    started: float | None = None  # unix time
    retry_of: int | None = None


@dataclass
class StudyResult:
    name: str
    backend: str
    direction: Literal["maximize", "minimize"]
    metric: str
    trials: list[TrialRecord]
    parent_run_id: str | None = None
    stopped_reason: str = ""  # why `run` stopped early (max_failures, timeout, signal), else ""
    exit_code: int = 0  # what `sweeps run` exits with (130/143 after a signal)

    def finished(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.state in ("COMPLETE", "PRUNED")]

    def best(self) -> TrialRecord | None:
        done = [t for t in self.trials if t.state == "COMPLETE" and t.value is not None]
        if not done:
            return None
        pick = max if self.direction == "maximize" else min
        return pick(done, key=lambda t: cast(float, t.value))  # done: trials with a value

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.state] = out.get(t.state, 0) + 1
        return out


class Backend(Protocol):
    name: str

    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False) -> StudyResult:
        """Called by ``sweeps run``: creates or resumes the study and runs trials until the
        total budget is met (or the timeout, a signal, or ``max_failures`` in a row)."""
        ...

    def load(self, spec: StudySpec) -> StudyResult:
        """Called by status/report/promote/rerun: the study as stored; never writes."""
        ...
