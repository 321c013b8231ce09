"""One seed drives python, numpy, torch (CPU and CUDA) and the data loaders."""
from __future__ import annotations

import os
import random
from typing import cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


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


def loader_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of one epoch's shuffling. Derived from (seed, epoch) rather than
    carried across epochs, so a run resumed at epoch k shuffles exactly as a straight run."""
    return torch.Generator().manual_seed(seed * 100_003 + epoch)


def worker_init_fn(worker_id: int) -> None:
    """Seed numpy and python in each loader worker from torch's per-worker seed
    (which itself comes from the loader's generator), so augmentation repeats exactly."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def rng_state() -> dict:
    """All RNG states as tensors and plain lists, loadable with ``torch.load(weights_only=True)``."""
    # The legacy tuple (the default); numpy's stub types a call without arguments as the dict form.
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state = {
        "python": list(random.getstate()[1]) + [random.getstate()[0]],
        "python_gauss": random.getstate()[2],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[-1], tuple(py[:-1]), state["python_gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
