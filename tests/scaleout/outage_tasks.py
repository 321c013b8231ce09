"""A user task (``task.target``) whose trials wait at barriers the outage test opens.

Each trial takes the next arrival ticket (0, 1, 2, ... in the order trials build their model,
claimed with O_EXCL files, so two worker processes never share one). After its first epoch a
trial whose ticket is in ``OUTAGE_HOLD_<n>`` (e.g. ``0,1``) writes ``at-<ticket>`` and waits for
the file ``go-<n>``: the test acts while the trials are held at a known point, never racing them.
"""
from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from torch import nn

from core.tasks import task
from core.tasks.digits import DigitsTask


def _ticket(folder: Path) -> int:
    for n in itertools.count():
        try:
            os.close(os.open(folder / f"ticket-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _gate_of(ticket: int) -> str | None:
    for name, value in os.environ.items():
        if name.startswith("OUTAGE_HOLD_") and str(ticket) in value.split(","):
            return name[len("OUTAGE_HOLD_"):]
    return None


class _HoldAfter(nn.Module):
    """After ``calls`` training forwards (one epoch), announce ``at`` and wait for ``go``."""

    def __init__(self, inner: nn.Module, calls: int, at: Path, go: Path) -> None:
        super().__init__()
        self.inner, self.calls, self.seen, self.at, self.go = inner, calls, 0, at, go

    def forward(self, x):
        if self.training:
            self.seen += 1
            if self.seen == self.calls + 1:
                self.at.touch()
                while not self.go.exists():
                    time.sleep(0.05)
        return self.inner(x)


class HeldTask(DigitsTask):
    def build_model(self):
        model = super().build_model()
        folder = Path(os.environ["OUTAGE_DIR"])
        ticket = _ticket(folder)
        gate = _gate_of(ticket)
        if gate is None:
            return model
        return _HoldAfter(model, int(os.environ["OUTAGE_EPOCH_STEPS"]), folder / f"at-{ticket}", folder / f"go-{gate}")


@task
def make_held_task(model: str = "mlp") -> HeldTask:
    return HeldTask(model)
