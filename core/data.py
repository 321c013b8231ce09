"""DataLoaders built from the config and the task: seeded per batch, resumable mid-epoch, DDP-aware.

Exact resume (docs/ARCHITECTURE.md, "Exact resume of the data"): the data's randomness
(augmentation) is seeded per batch from the batch's position, (seed, split, epoch, rank, worker,
batch), by ``core.seeding.data_rngs``. A batch's augmentation is then the same whichever process
fetches it and wherever a run was resumed, and fetching data never moves the training's own RNG
stream (dropout, mixup), which the checkpoint saves.

- Map-style datasets (with a ``__len__``): :class:`KeyedBatches`, a batch sampler in the main
  process, yields batch b of epoch e as keys ``(e, b, index)`` in the order a DistributedSampler
  gives for (seed, e) on this rank; :class:`SeededItems` fetches a batch by its keys. A run
  resumed mid-epoch starts the sampler at its next batch: the batches before it are not fetched.
  Loader workers persist across epochs.
- Iterable datasets (streams): :class:`SeededStream` pulls whole batches, each with the RNGs
  seeded from (seed, split, epoch, rank, worker, its number in that process's stream). An epoch is
  ``train.max_steps_per_epoch`` batches (else the stream's ``len`` in batches), or fewer when the
  stream ends. Workers start afresh each epoch, with a fresh copy of the stream. A run resumed
  mid-epoch replays the epoch's stream from its start and drops the batches trained before the
  interrupt: they are fetched (and augmented) again, the cost of exactness for a stream.
- Datasets that are only tensors (``TensorPairDataset``, ``TensorDataset``) skip the DataLoader:
  :class:`core.in_memory.InMemoryBatches` gathers each batch by ``KeyedBatches``' indices from
  tensors placed on the device once, bitwise the same batches.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from core.config import TrainConfig
from core.distributed import DistContext
from core.in_memory import InMemoryBatches, stored_tensors
from core.seeding import data_rngs, data_seed
from core.tasks.base import DataError, Task, TaskError

TRAIN, VAL = 0, 1  # the split's part of a batch's seed
SCAN_ROWS = 4096  # samples scanned for non-finite values at a time: a bounded temporary at any dataset size
Key = tuple[int, int, int]  # (epoch, batch, index)


def resolve_num_workers(setting: int) -> int:
    """-1 means about half the CPU threads this process may use (the sweep pool sets
    that share per worker, so parallel trials do not oversubscribe the cores)."""
    if setting >= 0:
        return setting
    return max(0, torch.get_num_threads() // 2)


def check_datasets(task: Task, cfg: TrainConfig, train_ds: Dataset, val_ds: Dataset | None) -> None:
    """Refuse, before any step, what the loop cannot train on: an empty dataset (the loop would
    train on nothing and report a validation accuracy of 0.0 as if it had been measured), one
    with neither a length nor iteration, a stream without an epoch length, a collate_fn that
    cannot be called. Each message names the task and the field to change."""
    label = f"task {task.name!r} ({task.describe()})"
    if task.collate_fn is not None and not callable(task.collate_fn):
        raise TaskError(f"{label}: collate_fn is {task.collate_fn!r}, not a callable; set it to a function "
                        f"turning a list of samples into an (input, target) batch, or to None")
    for which, ds in (("train", train_ds), ("validation", val_ds)):
        if ds is None:
            continue
        if isinstance(ds, IterableDataset):
            if which == "train" and cfg.max_steps_per_epoch is None and not _has_len(ds):
                raise TaskError(f"{label} returned an iterable train dataset with no length, so an epoch has no "
                                f"end: set train.max_steps_per_epoch to the number of batches an epoch takes "
                                f"from the stream (or give the dataset a __len__)")
            continue
        if not _has_len(ds):
            raise TaskError(f"{label} returned a {which} dataset ({type(ds).__name__}) with no __len__ from "
                            f"datasets(); give it a __len__ (map-style) or make it a torch.utils.data.IterableDataset")
        if len(ds) == 0:  # type: ignore[arg-type]  # _has_len
            raise TaskError(f"{label} returned an empty {which} dataset (0 samples) "
                            f"from datasets(); check its data source")
        problem = nonfinite_problem(task, ds, which)
        if problem:  # found before any step: otherwise the first step's loss is NaN, "diverged"
            raise DataError(problem)


def nonfinite_problem(task: Task, ds: Dataset, which: str) -> str | None:
    """Why an in-memory dataset cannot be trained on: NaN or infinite values, counted per role
    with the samples holding them; None when it has none (or is not in memory: a stream or a
    dataset that reads files is not read here, a NaN in it stops the run at its step instead)."""
    tensors = {role: t for role, t in stored_tensors(ds).items() if t.is_floating_point() or t.is_complex()}
    if not tensors:
        return None
    n = len(next(iter(tensors.values())))
    bad_rows = torch.zeros(n, dtype=torch.bool)
    counts = {}
    for role, t in tensors.items():
        count = 0
        for start in range(0, len(t), SCAN_ROWS):
            bad = ~torch.isfinite(t[start:start + SCAN_ROWS])
            bad_rows[start:start + len(bad)] |= bad.reshape(len(bad), -1).any(1).cpu()
            count += int(bad.sum())
        if count:
            counts[role] = count
    if not counts:
        return None
    where = ", ".join(f"{c} in its {role}" for role, c in counts.items())
    name = task.describe_dataset(ds, "train" if which == "train" else "val")["name"]  # as the run's inputs say
    return (f"task {task.name!r}: its {which} dataset ({name}) holds "
            f"{sum(counts.values())} NaN or infinite values ({where}), in {int(bad_rows.sum())} of its {n} samples "
            f"(the first: sample {int(bad_rows.nonzero()[0])}): a problem of the data, not of the hyperparameters "
            f"(every step on them gives a non-finite loss); drop or repair those samples in datasets()")


def _has_len(ds: object) -> bool:
    try:
        len(ds)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


class KeyedBatches(Sampler[list[Key]]):
    """Batch sampler: batch b of epoch ``epoch`` as the keys ``(epoch, b, index)``, for b from
    ``start`` to ``batches - 1``. The indices come in ``order``'s order (a DistributedSampler is
    re-keyed with the epoch: its shuffle depends only on (seed, epoch)). Set ``epoch`` and
    ``start`` before each pass; the sampler lives in the main process, so persistent workers
    need not know them."""

    def __init__(self, order: Sequence[int] | DistributedSampler, batch_size: int, limit: int | None = None) -> None:
        self.order, self.batch_size = order, batch_size
        full = math.ceil(len(order) / batch_size)
        self.batches = full if limit is None else min(full, limit)
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return max(0, self.batches - self.start)

    def __iter__(self) -> Iterator[list[Key]]:
        return self._keys(self.epoch, self.start, self.indices(self.epoch))

    def indices(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s sample indices, in order (batch b is ``batch_size`` of them from ``b * batch_size``)."""
        if isinstance(self.order, DistributedSampler):
            self.order.set_epoch(epoch)
        return list(self.order)

    def _keys(self, epoch: int, start: int, indices: list[int]) -> Iterator[list[Key]]:
        size = self.batch_size
        for b in range(start, self.batches):
            yield [(epoch, b, i) for i in indices[b * size:(b + 1) * size]]


class SeededItems(Dataset):
    """A map-style dataset fetched a batch at a time by :class:`KeyedBatches`' keys, its RNGs
    seeded from (seed, split, epoch, rank, 0, batch). DataLoader calls ``__getitems__`` with a
    whole batch's keys; the inner dataset's own ``__getitems__`` is used when it has one."""

    def __init__(self, inner: Dataset, seed: int, split: int, rank: int) -> None:
        self.inner, self.seed, self.split, self.rank = inner, seed, split, rank

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]  # map-style: has a len

    def __getitems__(self, keys: list[Key]) -> Any:
        epoch, batch, _ = keys[0]
        indices = [index for _, _, index in keys]
        getitems = getattr(self.inner, "__getitems__", None)
        with data_rngs(data_seed(self.seed, self.split, epoch, self.rank, 0, batch)):
            return getitems(indices) if getitems else [self.inner[i] for i in indices]

    def __getitem__(self, key: Key) -> Any:
        return self.__getitems__([key])[0]


class SeededStream(IterableDataset):
    """An iterable dataset as lists of ``batch_size`` samples (the last may be shorter), each
    list pulled with the RNGs seeded from (seed, split, ``epoch``, rank, worker, its number in
    this process's stream); worker 0 is the main process, loader worker k is k + 1."""

    def __init__(self, inner: IterableDataset, seed: int, split: int, rank: int, batch_size: int) -> None:
        self.inner, self.seed, self.split, self.rank, self.batch_size = inner, seed, split, rank, batch_size
        self.epoch = 0

    def __iter__(self) -> Iterator[list[Any]]:
        info = get_worker_info()
        return self._batches(self.epoch, 0 if info is None else info.id + 1)

    def _batches(self, epoch: int, worker: int) -> Iterator[list[Any]]:
        samples: Iterator[Any] | None = None
        for b in itertools.count():
            with data_rngs(data_seed(self.seed, self.split, epoch, self.rank, worker, b)):
                if samples is None:  # iter() may run the stream's own code: seeded too
                    samples = iter(self.inner)
                batch = list(itertools.islice(samples, self.batch_size))
            if batch:
                yield batch
            if len(batch) < self.batch_size:
                return


class TrainBatches:
    """One rank's training data, epoch by epoch (what :func:`make_train_loader` returns):
    ``len()`` is the micro-batches of an epoch, ``epoch(e, start)`` yields ``(i, (x, y))``."""

    def __init__(self, loader: DataLoader, batches: int, keys: KeyedBatches | None = None,
                 stream: SeededStream | None = None) -> None:
        self.loader, self.batches, self.keys, self.stream = loader, batches, keys, stream

    def __len__(self) -> int:
        return self.batches

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[int, Any]]:
        """Micro-batches ``start`` to ``len(self) - 1`` of ``epoch`` (fewer when a stream ends first)."""
        if self.keys is not None:  # the sampler starts at `start`: nothing before it is fetched
            self.keys.epoch, self.keys.start = epoch, start
            return enumerate(self.loader, start)
        assert self.stream is not None
        self.stream.epoch = epoch  # read by the workers this pass starts, or in this process
        return itertools.islice(enumerate(self.loader), start, self.batches)


def make_train_loader(ds: Dataset, cfg: TrainConfig, device: torch.device, ctx: DistContext,
                      collate_fn: Callable | None = None) -> TrainBatches | InMemoryBatches:
    """Shuffling comes from a DistributedSampler seeded with ``cfg.seed`` and re-keyed each epoch,
    in single-process runs too: the order of epoch k depends only on (seed, k), which makes
    resume exact and keeps one code path for DDP. A stream is read as it comes (it shards
    itself under DDP, see ``Task``). A dataset that is only tensors is gathered batch by batch
    on the device, in the same order, without a DataLoader (``core.in_memory``)."""
    if isinstance(ds, IterableDataset):
        if cfg.max_steps_per_epoch is None and not _has_len(ds):
            raise ValueError("an iterable train dataset with no length needs train.max_steps_per_epoch")
        batches = cfg.max_steps_per_epoch or math.ceil(len(ds) / cfg.batch_size)  # type: ignore[arg-type]
        stream = SeededStream(ds, cfg.seed, TRAIN, ctx.rank, cfg.batch_size)
        return TrainBatches(_loader(stream, cfg, device, collate_fn, None), batches, stream=stream)
    order: DistributedSampler[int] = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank,
                                                        shuffle=True, seed=cfg.seed, drop_last=False)
    keys = KeyedBatches(order, cfg.batch_size, cfg.max_steps_per_epoch)
    gathered = InMemoryBatches.of(ds, collate_fn, device, keys)
    if gathered is not None:
        return gathered
    loader = _loader(SeededItems(ds, cfg.seed, TRAIN, ctx.rank), cfg, device, collate_fn, keys)
    return TrainBatches(loader, keys.batches, keys=keys)


def make_val_loader(ds: Dataset, cfg: TrainConfig, device: torch.device, ctx: DistContext,
                    collate_fn: Callable | None = None) -> DataLoader | InMemoryBatches:
    """Each rank validates a strided shard with no padding (a stream shards itself), so summed
    metrics count every sample once; a stream is read to its end. Randomness in the validation
    data, if any, is seeded per batch as in training, the same every epoch."""
    if isinstance(ds, IterableDataset):
        return _loader(SeededStream(ds, cfg.seed, VAL, ctx.rank, cfg.batch_size), cfg, device, collate_fn, None)
    keys = KeyedBatches(range(ctx.rank, len(ds), ctx.world_size), cfg.batch_size)  # type: ignore[arg-type]
    gathered = InMemoryBatches.of(ds, collate_fn, device, keys)
    if gathered is not None:
        return gathered
    return _loader(SeededItems(ds, cfg.seed, VAL, ctx.rank), cfg, device, collate_fn, keys)


def _loader(ds: Dataset, cfg: TrainConfig, device: torch.device, collate_fn: Callable | None,
            keys: KeyedBatches | None) -> DataLoader:
    """``keys`` batches a map-style dataset; without, ``ds`` is a SeededStream yielding batches."""
    workers = resolve_num_workers(cfg.num_workers)
    # A batch sampler, or no batching at all: a SeededStream's items are already batches.
    extra: dict[str, Any] = {"batch_sampler": keys} if keys is not None else {"batch_size": None}
    if workers > 0:
        # Map-style: workers stay alive across epochs (the keys carry the epoch). A stream's
        # are started each epoch, each with a copy of the stream holding the epoch.
        extra |= {"persistent_workers": keys is not None, "prefetch_factor": cfg.prefetch_factor}
    return DataLoader(
        ds, num_workers=workers, collate_fn=collate_fn or default_collate,
        pin_memory=cfg.pin_memory and device.type == "cuda",  # page-locked memory only helps host->GPU copies
        # Its own generator: the loader draws a base seed per pass, which must not move the global RNG.
        generator=torch.Generator().manual_seed(cfg.seed), **extra,
    )
