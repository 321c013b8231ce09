"""Small configs that train in well under a second on CPU."""
from __future__ import annotations

from core.config import TrainConfig


def fast_config(**overrides) -> TrainConfig:
    base = dict(epochs=2, batch_size=32, lr=0.05, scheduler="constant", num_workers=0,
                save_checkpoints=False, seed=0)
    base.update(overrides)
    return TrainConfig(**base)
