"""A small on-disk cache of the arrays a built-in task reads from scikit-learn.

Importing scikit-learn costs a fresh worker process 2 to 3 s of CPU, more than a short trial
trains (benchmarks/README.md, orchestration), so the digits and diabetes tasks keep what it
gives them in one ``.npz`` per split under ``SWEEPS_CACHE_DIR`` (else
``$XDG_CACHE_HOME/sweeps``, else ``~/.cache/sweeps``), keyed by scikit-learn's version. A
damaged or unsound file is computed again and replaced; a folder that cannot be written is
not an error (the arrays are then computed every time).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from core.io_utils import atomic_write_bytes

Arrays = tuple[np.ndarray, ...]


def sklearn_cache_file(folder: str, prefix: str, key: str) -> Path | None:
    """``<cache root>/<folder>/<prefix>-sklearn<version>-<key>.npz``; None without
    scikit-learn's metadata (read without importing it)."""
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None
    root = os.environ.get("SWEEPS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sweeps")
    return Path(root) / folder / f"{prefix}-sklearn{version}-{key}.npz"


def cached_arrays(path: Path | None, names: tuple[str, ...], compute: Callable[[], Arrays],
                  sound: Callable[..., bool]) -> Arrays:
    """The arrays ``names`` from ``path`` when it holds a copy that ``sound(*arrays)`` accepts,
    else ``compute()``, written to ``path`` for the next process (atomically, so concurrent
    workers or DDP ranks never read half a file)."""
    if path is not None:
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays: Arrays = tuple(z[name] for name in names)
            if sound(*arrays):
                return arrays
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
            pass  # absent or damaged: computed again below and the file replaced
    arrays = compute()
    named: dict[str, Any] = dict(zip(names, arrays, strict=True))
    if path is not None:
        with contextlib.suppress(OSError):  # a read-only home: the next run computes it again
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, lambda fh: np.savez(fh, **named))
    return arrays


def is_split(n: int, train: np.ndarray, val: np.ndarray) -> bool:
    """Integer index arrays that split ``0..n-1`` into train and val."""
    return (train.dtype.kind == val.dtype.kind == "i"
            and np.array_equal(np.sort(np.concatenate([train, val])), np.arange(n)))
