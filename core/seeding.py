"""One seed drives python, numpy, torch (CPU and CUDA) and the data loaders.

The training's randomness (initialisation, dropout, mixup) draws from the global generators
seeded by :func:`seed_everything` and saved in every checkpoint. The data's randomness
(augmentation) is seeded per batch from the batch's position (:func:`data_seed`, :func:`data_rngs`,
used by ``core.data``), so it does not depend on loader workers or on where a run was resumed:
no per-worker ``worker_init_fn`` or per-epoch loader generator is needed."""
from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import cast

import numpy as np
import torch
from torch.utils.data import get_worker_info


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def member_generator(device: torch.device, state: torch.Tensor | None = None) -> torch.Generator:
    """A generator on ``device`` holding ``state``, or the global stream's state now (that device's
    default generator): a member of a population draws its dropout masks from it, as its run alone
    would draw them from the global stream (core/population.py)."""
    generator = torch.Generator(device=device)
    if state is None:
        state = torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)
    generator.set_state(state)
    return generator


def configure_determinism(enabled: bool) -> None:
    """Opt-in deterministic kernels. Costs speed on GPU, so it is off by default.

    CUBLAS_WORKSPACE_CONFIG must be set before the first cuBLAS call for deterministic
    matmuls on CUDA >= 10.2; setting it here is harmless on CPU.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


_MASK64 = 2**64 - 1


def data_seed(*key: int) -> int:
    """A 64-bit seed from integers (SplitMix64 over the parts): the key of one batch's data
    randomness, e.g. (run seed, split, epoch, rank, worker, batch), so nearby keys get unrelated seeds."""
    h = 0
    for part in key:
        h = ((h ^ (part & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


@contextlib.contextmanager
def data_rngs(seed: int) -> Iterator[None]:
    """Run the block (fetching one batch) with torch's CPU generator, ``random`` and numpy seeded
    from ``seed``. In the main process (``num_workers=0``) torch's stream, the training's own
    (initialisation, dropout, mixup: what a checkpoint saves), is put back afterwards, as if no data
    had been drawn. ``random`` and numpy are left as the batch left them: the loop draws nothing
    from them, every batch re-seeds them before drawing, so what they hold between batches is a
    function of the last batch's key, the same after a resume; and copying numpy's state both ways
    would cost more than the rest of the fetch (benchmarks/README.md, exact resume of the data).
    ``torch.default_generator`` rather than ``torch.manual_seed``, which seeds every CUDA device too."""
    saved = torch.default_generator.get_state() if get_worker_info() is None else None
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed >> 32)
    try:
        yield
    finally:
        if saved is not None:
            torch.default_generator.set_state(saved)


def rng_state() -> dict:
    """All RNG states as tensors and plain lists, loadable with ``torch.load(weights_only=True)``."""
    # The legacy tuple (the default); numpy's stub types a call without arguments as the dict form.
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    py = random.getstate()
    state = {
        # One tensor, not a list of 625 ints: torch.save pickles a list item by item, and this
        # was half the objects of a small model's checkpoint.
        "python": torch.tensor([*py[1], py[0]], dtype=torch.int64),
        "python_gauss": py[2],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    py = py.tolist() if isinstance(py, torch.Tensor) else py  # a list in checkpoints written before
    random.setstate((py[-1], tuple(py[:-1]), state["python_gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
