"""User tasks for the Ray trust tests (``task.target: tests.sweeps.backends.ray_trust_tasks:make_task``):
the digits MLP, except that the model's ``width`` picks a misbehaviour while the model is built."""
from __future__ import annotations

import sys
import time

from core.tasks import task
from core.tasks.digits import DigitsTask

EXIT_WIDTH = 40  # the task calls sys.exit(0)
RAISE_WIDTH = 48  # the task raises
# Both misbehave only after this long, so a failed trial's shown duration can be told from one never
# measured (which shows 0.0s); without it, an exit right after a warm start really takes under 0.05 s.
MISBEHAVE_AFTER_S = 0.3


class MisbehavingDigits(DigitsTask):
    name = "misbehaving_digits"

    def build_model(self):
        if self.width in (EXIT_WIDTH, RAISE_WIDTH):
            time.sleep(MISBEHAVE_AFTER_S)
        if self.width == EXIT_WIDTH:
            sys.exit(0)
        if self.width == RAISE_WIDTH:
            raise RuntimeError(f"misbehaving task: width {self.width} always fails")
        return super().build_model()


@task
def make_task(model: str = "mlp", width: int = 32, val_fraction: float = 0.2) -> MisbehavingDigits:
    return MisbehavingDigits(model=model, width=width, val_fraction=val_fraction)
