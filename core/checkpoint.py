"""Checkpoints: written atomically, read with ``weights_only=True``, with fall-back.

Layout in a run's output folder: ``last.pt`` (latest epoch or interruption point),
``last.prev.pt`` (the one before, kept as a fall-back when ``last.pt`` is corrupt),
``best.pt`` (best value of ``cfg.monitor``), and ``best.prev.pt`` only while a save replaces
``best.pt`` (see :func:`save_last`).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, cast

import torch

from core.faults import Fault, stop_here

LAST, PREV, BEST, BEST_PREV = "last.pt", "last.prev.pt", "best.pt", "best.prev.pt"
_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or is not this run's; the message names the file and why."""


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, fsync, then ``os.replace``:
    a crash or a full disk never leaves a half-written file under the final name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_synced(state, path.parent, f".{path.name}.")
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_last(state: dict[str, Any], out_dir: Path, best: dict[str, Any] | None = None) -> Path:
    """Rotate ``last.pt`` to ``last.prev.pt``, then write the new ``last.pt``.
    The rotation is a rename, so at every moment at least one good file exists.

    ``best``: what ``best.pt`` holds from now on, ``state`` itself (this epoch is the best: one
    file, two names) or the weights of an earlier best epoch that wrote no checkpoint. ``best.pt``
    is in place before ``last.pt`` records that best, and the ``best.pt`` it replaces stays as
    ``best.prev.pt`` until ``last.pt`` is: after a kill in between, :func:`settle_best` keeps
    whichever of the two ``last.pt`` records, so a resumed run never depends on training an epoch
    again the same way to get its best weights back."""
    out_dir = Path(out_dir)
    last = out_dir / LAST
    # Write first so a failure (ENOSPC) leaves last.pt untouched.
    tmp = _write_synced(state, out_dir, ".last.")
    had_best = (out_dir / BEST).exists()
    try:
        if best is not None:
            _keep_previous_best(out_dir)
            if best is state:
                _same_file(tmp, out_dir / BEST, state)
            else:
                save_checkpoint(best, out_dir / BEST)
        if last.exists():
            os.replace(last, out_dir / PREV)
        os.replace(tmp, last)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if (out_dir / BEST_PREV).exists():  # last.pt still records the best best.prev.pt holds
            os.replace(out_dir / BEST_PREV, out_dir / BEST)
        elif not had_best:  # nor any best at all
            (out_dir / BEST).unlink(missing_ok=True)
        raise
    (out_dir / BEST_PREV).unlink(missing_ok=True)
    return last


def _keep_previous_best(out_dir: Path) -> None:
    """``best.prev.pt``: a second name for the current ``best.pt`` (moved there where the
    filesystem has no hard links), until the save that replaces it has its ``last.pt`` in place."""
    best, prev = out_dir / BEST, out_dir / BEST_PREV
    prev.unlink(missing_ok=True)
    if best.exists():
        try:
            os.link(best, prev)
        except OSError:
            os.replace(best, prev)


def settle_best(out_dir: Path, best_epoch: int | None) -> None:
    """Before a run resumes from a checkpoint that records ``best_epoch`` as its best (None: no
    checkpoint, or none with a best yet): make ``best.pt`` the one that checkpoint records. A
    ``best.pt`` that a killed save had replaced before its ``last.pt`` was in place is put back;
    a ``best.pt`` without a recorded best is a killed attempt's, and goes. Also removes what a kill
    leaves (:func:`remove_leftovers`)."""
    out_dir = Path(out_dir)
    best, prev = out_dir / BEST, out_dir / BEST_PREV
    if best_epoch is None:
        best.unlink(missing_ok=True)
        prev.unlink(missing_ok=True)
    elif prev.exists():
        try:
            current = load_checkpoint(best).get("best_epoch")
        except CheckpointError:  # missing (moved aside without hard links) or unreadable
            current = None
        if current != best_epoch:
            os.replace(prev, best)
        else:
            prev.unlink()
    remove_leftovers(out_dir)


def remove_leftovers(out_dir: Path) -> None:
    """The temporary files a kill in a save leaves in ``out_dir``: a half-written or not yet renamed
    checkpoint (a whole one's size each), a link not yet renamed."""
    for pattern in (".last.*.tmp", f".{BEST}.*.tmp", f".{BEST}.*.link"):
        for leftover in Path(out_dir).glob(pattern):
            leftover.unlink(missing_ok=True)


def _write_synced(state: dict[str, Any], folder: Path, prefix: str) -> Path:
    """``state`` in a new temporary file in ``folder``, fsynced; removed again if that fails."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            stop_here(Fault.MID_CHECKPOINT)  # tests: a kill while the new file is not yet in place
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise
    return Path(name)


def _same_file(src: Path, path: Path, state: dict[str, Any]) -> None:
    """``path`` holding what ``src`` (just written from ``state``) holds: a hard link to it, made
    under a temporary name and renamed into place, so ``best.pt`` costs no second serialisation
    and fsync each epoch it improves. Checkpoint files are only ever replaced, never rewritten in
    place, so the two names cannot see each other's later writes. Where the filesystem has no
    hard links, ``state`` is written again."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.link"
    try:
        tmp.unlink(missing_ok=True)
        os.link(src, tmp)
    except OSError:
        save_checkpoint(state, path)
        return
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load with ``weights_only=True``: tensors and plain containers only. A file that
    carries a pickled Python object is refused, and its payload never runs."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path} refused: it contains Python objects beyond tensors and plain "
            f"containers (a pickle payload), so it was not loaded. Only load checkpoints you trust "
            f"by other means. Detail: {str(exc).splitlines()[0]}"
        ) from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from exc


def load_resume_state(out_dir: Path, owner: str | None = None) -> tuple[dict[str, Any], Path] | None:
    """The newest readable checkpoint to resume from: ``last.pt``, else ``last.prev.pt``.

    Returns None only when neither file exists (a fresh start). When files exist but
    none can be read, raises CheckpointError: never a silent restart from epoch 0.
    With ``owner`` given, the checkpoint must have been written for that owner
    (:func:`check_owner`), else CheckpointError.
    """
    out_dir = Path(out_dir)
    candidates = [out_dir / LAST, out_dir / PREV]
    errors: list[str] = []
    for path in candidates:
        if not path.exists():
            continue
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            errors.append(str(exc))
            warnings.warn(f"{exc}; falling back to the previous checkpoint", RuntimeWarning, stacklevel=2)
            continue
        check_owner(state, path, owner)
        return state, path
    if errors:
        raise CheckpointError("no readable checkpoint to resume from:\n  " + "\n  ".join(errors))
    return None


def check_owner(state: dict[str, Any], path: Path, owner: str | None) -> None:
    """Refuse a checkpoint written for another owner (another trial, another study that used
    the same folder): training on it would pass off someone else's weights as this run's.
    ``owner`` None (a plain ``train()`` call) checks nothing."""
    if owner is None:
        return
    found = state.get("owner")
    if found == owner:
        return
    whose = f"belongs to {found!r}" if found is not None else "records no owner"
    raise CheckpointError(f"checkpoint {path} {whose}, but the run resuming from it is {owner!r}: refusing to "
                          f"train on another run's checkpoint; move the folder aside or start the run without resume")


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) key prefixes."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix):]
                    changed = True
        out[key] = value
    return out


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = cast(torch.nn.Module, model._orig_mod)  # torch.compile's wrapper keeps the module there
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model
