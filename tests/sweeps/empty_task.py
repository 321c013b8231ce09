"""A user task (loaded through ``task.target: tests.sweeps.empty_task:make_empty_val_task``) whose
validation data comes back empty, as from a data folder with no validation images."""
from __future__ import annotations

from torch.utils.data import Subset

from core.tasks import task
from core.tasks.digits import DigitsTask


class EmptyValDigits(DigitsTask):
    name = "empty_val_digits"

    def datasets(self):
        train, val = super().datasets()
        return train, Subset(val, [])


@task
def make_empty_val_task(model: str = "mlp") -> EmptyValDigits:
    return EmptyValDigits(model)
