"""The curves a run has reported so far, carried in its checkpoint.

A process can die after it reported a step or an epoch and before its reporter got the points
to the tracking store, and a retry often writes to a new tracking run. So the checkpoint keeps
every reported point, and ``train()`` hands them to the reporter of a resumed run
(``Reporter.resumed``): that run then ends with the same curves as an uninterrupted one.

Per-step values are stored as tensors, since checkpoints are read with ``weights_only=True``
(float64, which holds each reported Python float exactly, so the curves match bit for bit).
"""
from __future__ import annotations

import torch

from core.reporting import EpochReport, StepReport
from core.results import STEP_METRICS


class StepLog:
    """Every reported optimizer step's ``STEP_METRICS``, in order."""

    def __init__(self) -> None:
        self._rows: list[tuple] = []  # (step, *values in STEP_METRICS order): one tuple a step

    def add(self, step: int, metrics: dict[str, float]) -> None:
        """Called with each step's metrics as they are reported."""
        self._rows.append((step, *[metrics[k] for k in STEP_METRICS]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The log as one tensor per column, for the checkpoint."""
        columns = list(zip(*self._rows, strict=True)) if self._rows else [()] * (1 + len(STEP_METRICS))
        out = {"step": torch.tensor(columns[0], dtype=torch.int64)}
        out.update({k: torch.tensor(c, dtype=torch.float64) for k, c in zip(STEP_METRICS, columns[1:], strict=True)})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Replace the log by a checkpoint's (None: a checkpoint from before steps were kept)."""
        if not state:
            self._rows = []
            return
        self._rows = list(zip(state["step"].tolist(), *[state[k].tolist() for k in STEP_METRICS], strict=True))

    def reports(self) -> list[StepReport]:
        """The steps as ``report_step`` received them."""
        return [(row[0], dict(zip(STEP_METRICS, row[1:], strict=True))) for row in self._rows]


def epoch_reports(history: list[dict]) -> list[EpochReport]:
    """The epochs of a run's ``history`` as ``report_epoch`` received them."""
    return [(h["epoch"], h["step"], {k: v for k, v in h.items() if k not in ("epoch", "step")})
            for h in history]
