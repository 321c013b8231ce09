"""The gradients the loop measures (or clips) once per optimizer step, and clears between steps.

On CPU, small gradient tensors live in one flat buffer per dtype: each such parameter's
``.grad`` is a view into it, so zeroing them is one fill, their norm one reduction and clipping
them one multiply, instead of a call per tensor. Inside the training loop, right after a backward
pass, each call on a tensor costs several times its micro-benchmark (cold caches): on a small
CNN the per-tensor norm and zeroing, and ``clip_grad_norm_`` more so, took a measurable share of
its step (benchmarks/README.md, trainer overhead). Backward adds into a gradient that already
exists, in place, so the pooled views stay the gradients, with the same values (0 + g == g).

Large tensors keep PyTorch's default instead: their gradient is dropped between steps
(``set_to_none``) and backward allocates a fresh one. For them the flat buffer's cost, one more
pass over the memory to zero it and one to add into it, outweighs the saving: ResNet-18, nearly
all of whose weights are in tensors over 64k elements, trained slower with every tensor pooled.
On CUDA nothing is pooled: an extra in-place add is one more kernel launch per tensor, while the
norm there is already queued without waiting (core/step_stats.py). Under DDP nothing is pooled:
DDP owns the gradient buckets it all-reduces.

One difference from ``zero_grad(set_to_none=True)``: a pooled parameter that takes part in no
loss in a step (an unused branch) gets a zero gradient rather than none, so weight decay and
momentum still move it, as with ``set_to_none=False``.
"""
from __future__ import annotations

import math

import torch

from core.step_stats import gradient_norm

POOLED_MAX_ELEMENTS = 1 << 16  # 256 KiB of fp32: past this, zeroing and adding cost more than the call they save


class StepGradients:
    """The parameters' gradients across optimizer steps, on ``device``; ``distributed``: the
    run is one DDP rank. This class decides what is pooled and when gradients are cleared."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, distributed: bool) -> None:
        self.params = params
        self.device = device
        pool = device.type == "cpu" and not distributed
        self.unpooled: list[torch.Tensor] = []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if pool and p.numel() <= POOLED_MAX_ELEMENTS:
                by_dtype.setdefault(p.dtype, []).append(p)
            else:
                self.unpooled.append(p)
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its slice of a buffer)
        for dtype, group in by_dtype.items():
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
            offset = 0
            for p in group:
                self._views.append((p, buffer[offset:offset + p.numel()].view_as(p)))
                offset += p.numel()
            self.buffers.append(buffer)
        self.attach()

    def attach(self) -> None:
        """Called at set-up and at each epoch's start, after ``requires_grad`` may have changed
        (a backbone frozen for the first epochs): a trainable pooled parameter's ``.grad`` is its
        view; a frozen one's is None, so the optimizer leaves it alone, as with set_to_none."""
        for p, view in self._views:
            p.grad = view if p.requires_grad else None

    def before_backward(self) -> None:
        """Called before the backward pass of each optimizer step's first micro-batch. On CPU the
        gradients are cleared here rather than after the step: ResNet-18 in lockstep with the
        hand loop: 0.991 against 0.971 (medians of 5 alternating runs). Likely (not traced): a
        large gradient dropped right before backward leaves its memory to backward's new one;
        dropped after the step, the next forward's activations take it and backward's
        gradients take fresh pages."""
        if self.device.type == "cpu":
            self.zero_()

    def after_step(self) -> None:
        """Called after each optimizer step. On CUDA the gradients are cleared here, so the next
        forward's peak memory does not hold them (the caching allocator reuses blocks for free)."""
        if self.device.type != "cpu":
            self.zero_()

    def zero_(self) -> None:
        """Pooled gradients are zeroed, the others dropped (``set_to_none``)."""
        for buffer in self.buffers:
            buffer.zero_()
        for p in self.unpooled:
            p.grad = None

    def norm(self) -> torch.Tensor | float:
        """The total 2-norm of the step's gradients (what ``clip_grad_norm_`` measures), for the
        per-step curve and the divergence check. A float on CPU, a device tensor on CUDA."""
        return self._norm(self._unpooled_grads())

    def measure(self, limits: list[float | None], lanes: list[int]) -> list[torch.Tensor | float]:
        """The loop's call for its one run (``limits``: its ``grad_clip``): the norm, clipped to the
        limit when there is one (see ``core.population.StackedGradients`` for several runs)."""
        (limit,) = limits
        return [self.clip_(limit) if limit else self.norm()]

    def _unpooled_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.unpooled if p.grad is not None]

    def _norm(self, others: list[torch.Tensor]) -> torch.Tensor | float:
        if not self.buffers:
            return gradient_norm(others, self.device)
        parts = [float(torch.linalg.vector_norm(buffer)) for buffer in self.buffers]
        if others:
            parts.append(float(gradient_norm(others, self.device)))
        return math.hypot(*parts)

    def clip_(self, max_norm: float) -> torch.Tensor | float:
        """Called after each step's backward when ``train.grad_clip`` is set: scale the gradients
        so their total norm is at most ``max_norm``, as ``clip_grad_norm_`` does (factor
        ``max_norm / (norm + 1e-6)``), and return the norm before clipping. With pooled gradients
        that is one multiply per buffer, and none at all when the norm is under the limit (a
        factor of 1.0 changes nothing). A non-finite norm is returned as it is: the loop stops
        the run on it before the optimizer step."""
        if not self.buffers:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm=max_norm)
        others = self._unpooled_grads()
        total = self._norm(others)
        factor = max_norm / (total + 1e-6)
        if factor < 1.0:
            for buffer in self.buffers:
                buffer.mul_(factor)
            if others:
                torch._foreach_mul_(others, factor)
        return total
