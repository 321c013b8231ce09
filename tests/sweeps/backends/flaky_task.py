"""A user task (``task.target: tests.sweeps.backends.flaky_task:make_task``) that fails for
one value of a searched argument: the digits MLP, except that ``width == FAILING_WIDTH``
raises while the model is built. Every build is logged to ``flaky_attempts.log`` in the
working directory, so a test can count the attempts (retries) per width."""
from __future__ import annotations

from pathlib import Path

from core.tasks import task
from core.tasks.digits import DigitsTask

FAILING_WIDTH = 48
ATTEMPTS_LOG = "flaky_attempts.log"


class FlakyDigits(DigitsTask):
    name = "flaky_digits"

    def build_model(self):
        with open(Path(ATTEMPTS_LOG), "a") as fh:
            fh.write(f"{self.width}\n")
        if self.width == FAILING_WIDTH:
            raise RuntimeError(f"flaky task: width {self.width} always fails")
        return super().build_model()


@task
def make_task(model: str = "mlp", width: int = 32, val_fraction: float = 0.2) -> FlakyDigits:
    return FlakyDigits(model=model, width=width, val_fraction=val_fraction)
