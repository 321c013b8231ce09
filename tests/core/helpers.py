"""Small configs that train in well under a second on CPU."""
from __future__ import annotations

from core.config import TrainConfig
from core.reporting import Decision, RecordingReporter


def fast_config(**overrides) -> TrainConfig:
    base = dict(epochs=2, batch_size=32, lr=0.05, scheduler="constant", num_workers=0,
                save_checkpoints=False, seed=0)
    base.update(overrides)
    return TrainConfig(**base)


class StopAt(RecordingReporter):
    """Records like RecordingReporter; interrupts at optimizer step ``step`` or after epoch ``epoch``
    (there ``at_epoch``: INTERRUPT, or PRUNE)."""

    def __init__(self, step: int | None = None, epoch: int | None = None,
                 at_epoch: Decision = Decision.INTERRUPT) -> None:
        super().__init__()
        self.stop_step, self.stop_epoch, self.at_epoch = step, epoch, at_epoch

    def report_step(self, step, metrics):
        super().report_step(step, metrics)
        return Decision.INTERRUPT if step == self.stop_step else Decision.CONTINUE

    def report_epoch(self, epoch, step, metrics):
        super().report_epoch(epoch, step, metrics)
        return self.at_epoch if epoch == self.stop_epoch else Decision.CONTINUE
