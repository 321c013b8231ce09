"""Does a loader resumed mid-epoch give the straight run's batches, augmentation included?

torchdata's StatefulDataLoader saves the sampler's and the workers' positions
(``state_dict()`` mid-epoch) but not the RNG streams the workers augment with, so a restored
loader yields the right samples with other random crops. core.data seeds each batch's
randomness from its position instead (docs/ARCHITECTURE.md, "Exact resume of the data").

    PYTHONPATH=. .venv/bin/python benchmarks/stateful_loader_check.py

Prints one line per loader: whether the resumed batches have the straight run's order and
augmentation. Needs torchdata (not a dependency of the project).
"""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset

N, BATCH, STOP, WORKERS = 64, 4, 5, 2  # stop after 5 of the epoch's 16 batches


class Augmented(Dataset):
    """Sample i: the index (the order) and noise from torch, numpy and random (the augmentation)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        noise = torch.rand(3) + float(np.random.rand()) + random.random()
        return torch.cat([torch.tensor([float(i)]), noise]), i


def _compare(straight: list, resumed: list) -> tuple[bool, bool]:
    same_order = all(torch.equal(a[1], b[1]) for a, b in zip(straight, resumed, strict=True))
    same_values = all(torch.equal(a[0], b[0]) for a, b in zip(straight, resumed, strict=True))
    return same_order, same_values


def stateful(workers: int) -> tuple[bool, bool]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(Augmented(), batch_size=BATCH, shuffle=True, num_workers=workers,
                                  generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    straight_loader = loader()
    batches, state = [], None
    for b, batch in enumerate(straight_loader):
        batches.append(batch)
        if b == STOP - 1:
            state = straight_loader.state_dict()  # what a checkpoint would hold
    torch.manual_seed(0)  # a fresh process
    resumed_loader = loader()
    resumed_loader.load_state_dict(state)
    return _compare(batches[STOP:], list(resumed_loader))


def ours(workers: int) -> tuple[bool, bool]:
    from core.config import TrainConfig
    from core.data import make_train_loader
    from core.distributed import DistContext

    cfg = TrainConfig(batch_size=BATCH, num_workers=workers, seed=0)
    straight = [batch for _, batch in make_train_loader(Augmented(), cfg, torch.device("cpu"), DistContext()).epoch(1)]
    torch.manual_seed(0)  # a fresh process
    resumed = make_train_loader(Augmented(), cfg, torch.device("cpu"), DistContext())
    return _compare(straight[STOP:], [batch for _, batch in resumed.epoch(1, start=STOP)])


def main() -> None:
    print(f"{N} samples, batch {BATCH}, stopped after batch {STOP} of {N // BATCH}; "
          "augmentation from torch, numpy, random")
    rows = [(f"torchdata StatefulDataLoader, num_workers={WORKERS}", stateful(WORKERS))]
    rows += [(f"core.data (per-batch seeds), num_workers={w}", ours(w)) for w in (0, WORKERS)]
    for name, (order, values) in rows:
        print(f"{name}: same order {order}, same augmentation {values}")


if __name__ == "__main__":
    main()
