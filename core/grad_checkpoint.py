"""Gradient checkpointing of named blocks (``Task.checkpoint_blocks``): their activations are not
kept for backward but recomputed from the block's input (``torch.utils.checkpoint``, non-reentrant),
trading one more forward of those blocks for the memory of their activations.

Each named module's ``forward`` is replaced on that instance by a bound method, so parameter and
buffer names (checkpoints, ONNX export, promote) do not change, and a deep copy (the best model
at the end of a run) checkpoints its own blocks. In eval mode or without grad it is the plain
forward. BatchNorm running statistics inside a block are restored after the recomputation: a
recomputed forward in training mode would otherwise update them twice per step, and the
checkpointed run would not train the same model as the plain one.
"""
from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from core.tasks.base import TaskError


def checkpoint_blocks(model: nn.Module, names: Sequence[str], task_name: str) -> None:
    """Checkpoint each submodule of ``model`` named in ``names`` (``model.named_modules()`` names).
    Called once, when the run builds its model; an unknown name raises TaskError listing the names."""
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules or name == "":
            top = [n for n in modules if n and "." not in n]
            raise TaskError(f"task {task_name!r}: checkpoint_blocks names {name!r}, which is not a submodule of "
                            f"the model; use names from model.named_modules(), e.g. {', '.join(top[:8])}")
        module = modules[name]
        module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    plain = functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return plain(*args, **kwargs)
    return checkpoint(_Recomputable(self, plain), *args, use_reentrant=False, **kwargs)


class _Recomputable:
    """The block's forward for one checkpointed call: the first call is the forward pass, a later
    one is backward's recomputation, which leaves BatchNorm statistics as the first call left them."""

    def __init__(self, module: nn.Module, forward: Any) -> None:
        self.module, self.forward, self.calls = module, forward, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        with _norm_stats_kept(self.module):
            return self.forward(*args, **kwargs)


@contextlib.contextmanager
def _norm_stats_kept(module: nn.Module) -> Iterator[None]:
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    saved = [{k: b.clone() for k, b in m.named_buffers(recurse=False) if b is not None} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved, strict=True):
                for k, value in buffers.items():
                    getattr(m, k).copy_(value)
