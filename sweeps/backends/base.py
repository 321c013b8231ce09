"""The Backend interface and the read-only view of a study that every command shares."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

from sweeps.pareto import pareto_front
from sweeps.spec.model import StudySpec


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
    values: list[float] | None = None  # every objective's value, in the spec's order (COMPLETE trials)
    figures: dict[str, float] = field(default_factory=dict)  # deployment figures (sweeps.deploy_check)
    rejected: bool = False  # PRUNED before training: its architecture violates a constraint
    pack: str = ""  # resources.pack: "packed with trials ..." or "alone: why"

    def objective_values(self, metrics: list[str]) -> dict[str, float]:
        """``{metric: value}`` of the objectives, with the deployment figures (what --where reads)."""
        return {**self.figures, **dict(zip(metrics, self.values or [], strict=False))}


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
    metrics: list[str] = field(default_factory=list)  # every objective (empty: the one above)
    directions: list[str] = field(default_factory=list)  # one per metric

    def objectives(self) -> list[tuple[str, str]]:
        """``[(metric, direction), ...]``: ``objectives`` of the spec, or its one objective."""
        return list(zip(self.metrics, self.directions, strict=True)) or [(self.metric, self.direction)]

    def front(self) -> list[TrialRecord]:
        """The COMPLETE trials on the Pareto front of the objectives, computed from their stored
        values (sweeps.pareto); with one objective, the best trial(s)."""
        metrics, directions = zip(*self.objectives(), strict=True)
        several = len(metrics) > 1
        done = [t for t in self.trials if t.state == "COMPLETE"
                and (len(t.values or []) == len(metrics) if several else t.value is not None)]
        points = [cast(list[float], t.values) if several else [cast(float, t.value)] for t in done]
        return [done[i] for i in pareto_front(points, list(directions))]

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

    def run(self, spec: StudySpec, *, fresh: bool = False, quiet: bool = False,
            on_locked: Callable[[], None] | None = None) -> StudyResult:
        """Called by ``sweeps run``: creates or resumes the study and runs trials until the
        total budget is met (or the timeout, a signal, or ``max_failures`` in a row).
        ``on_locked`` runs once this run holds the study's run lock, before the study or its
        tracking store is written: what may only change a store no other run is using."""
        ...

    def load(self, spec: StudySpec) -> StudyResult:
        """Called by status/report/promote/rerun: the study as stored; never writes."""
        ...
