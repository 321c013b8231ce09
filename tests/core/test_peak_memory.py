"""``peak_mem_mb`` is the run's own peak, not the largest of every run its process trained before
(a sweep worker trains many trials in one process; ``peak_mem_mb`` may be an objective or a
constraint). In-process, as a worker does: a run holding a large dataset, then a small one."""
from __future__ import annotations

import math

from core.config import TrainConfig
from core.tasks.synthetic import SyntheticTask
from core.train import train

DATA_MB = 20_000 * 3 * 32 * 32 * 4 / 2**20  # the large run's inputs, float32: about 234 MiB


def _peak(n_train: int) -> float:
    cfg = TrainConfig(epochs=1, batch_size=64, device="cpu", num_workers=0, max_steps_per_epoch=2)
    result = train(SyntheticTask(model="mlp", shape=(3, 32, 32), n_train=n_train, n_val=64, width=8), cfg)
    assert result.status == "completed", result.reason
    return result.history[-1]["peak_mem_mb"]


def test_a_runs_peak_memory_is_its_own_not_the_largest_of_its_process():
    large = _peak(20_000)
    small = _peak(64)  # the same process, after the large run's data is freed
    again = _peak(20_000)
    # the large run's inputs were resident in it only, and the measure rises again with the next large run
    assert large > small + 0.6 * DATA_MB and again > small + 0.6 * DATA_MB, (large, small, again)
    assert math.isfinite(small) and small > 0
