"""Several runs of the same model shapes trained as one population (``resources.pack``).

One optimizer step of a small model costs more in Python and dispatch than in arithmetic. A
population stacks the members' parameters into one tensor per parameter name (``[K, ...]``) and
runs their forward and backward passes as one (HFTA, MLSys 2021, measures the gain): as one model
of grouped layers where the model is built of layers that allow it (core/fused_population.py),
else with ``torch.func.functional_call`` under ``vmap``. Everything else stays each member's own,
as if it trained alone: its model (a module whose parameters and buffers are views of its row of
the stacked tensors, so checkpoints, evaluation and export see a plain model), its optimizer and
scheduler built from its own config, its dropout masks drawn from its own generator in the order
it would draw them alone, its reporter, checkpoints and result. ``core.train`` runs the population
through the same loop as a single run; a member that is pruned, diverges or is interrupted leaves
it and the others go on.

What a population cannot hold is refused before anything trains (:class:`PackError`), so the
caller runs those members alone and says why (the rules on configs alone: core/pack_rules.py).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

from core.config import TrainConfig
from core.fused_population import FusedState, from_fused, fused_model, to_fused
from core.gradients import StepGradients
from core.reporting import Reporter
from core.tasks.base import Task

# How a population's members run (Population.layout), which stack_members tells its on_layout.
GROUPED, VMAP = "grouped layers", "vmap"
LayoutHook = Callable[[str], None]


class PackError(ValueError):
    """These runs cannot train as one population; the message says why (each can train alone)."""


@dataclass
class MemberRun:
    """One run of a population: what ``core.train.train`` takes for a single run."""

    cfg: TrainConfig
    reporter: Reporter | None = None
    out_dir: str | Path | None = None
    owner: str | None = None


def model_problem(models: list[nn.Module]) -> str | None:
    """Why these models cannot be stacked, or None: other parameter or buffer shapes, tied
    parameters, or a dropout the population cannot give each member its own masks for."""
    def shapes(m: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(n, tuple(t.shape), t.dtype) for n, t in [*m.named_parameters(), *m.named_buffers()]]

    first = shapes(models[0])
    for m in models[1:]:
        if shapes(m) != first:
            return "the members' models have different parameter or buffer shapes"
    for m in models:
        if len(list(m.named_parameters(remove_duplicate=False))) != len(list(m.parameters())):
            return "the model ties parameters (one tensor under two names)"
        if any(isinstance(mod, nn.modules.dropout._DropoutNd) and type(mod) is not nn.Dropout for mod in m.modules()):
            return "the model has a dropout other than nn.Dropout (its masks are not drawn per member)"
    return None


class MemberDropout(nn.Module):
    """``nn.Dropout`` inside the population's vmapped forward: each member's mask is drawn from its
    own generator, as ``torch.nn.functional.dropout`` on CPU draws it alone (``bernoulli_(1 - p)``
    on a tensor of the input's shape, divided by ``1 - p``), so a member gets the masks it would get
    trained by itself."""

    def __init__(self, p: float, lanes: LaneState) -> None:
        super().__init__()
        self.p, self.lanes = p, lanes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or self.lanes.quiet:
            return x
        gens = [self.lanes.generators[k] for k in self.lanes.live]
        masks = torch.stack([torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p, generator=g)
                             for g in gens])
        masks.div_(1 - self.p)
        return x * masks[self.lanes.lane]


@dataclass
class LaneState:
    """What the population's modules need to know during one vmapped call: the members' generators,
    the live members' indices, the lane index (a batched 0-d tensor under vmap)."""

    generators: list[torch.Generator]
    live: list[int] = field(default_factory=list)
    lane: Any = None
    quiet: bool = False  # a probe: MemberDropout draws nothing


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor, kind: str) -> None:
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    getattr(owner, kind)[leaf] = tensor


class Population(nn.Module):
    """K models of the same shapes as one module: ``forward(x, live)`` returns the live members'
    outputs stacked (``[L, batch, ...]``). ``x`` is one batch for all, or with ``per_member`` one
    batch per live member stacked. ``members[k]`` is member k's own model; its parameters are
    views of row k of :attr:`stacked` (the leaf tensors the backward pass fills), its buffers of
    row k of :attr:`stacked_buffers` (BatchNorm's running statistics update per member)."""

    def __init__(self, models: list[nn.Module], generators: list[torch.Generator]) -> None:
        super().__init__()
        self.lanes = LaneState(generators)
        # The members as one model of grouped layers where they are built of layers that allow it
        # (core/fused_population.py), else ``vmap`` of the template below; the probe decides.
        self.fused_state = FusedState()  # filled by each forward pass
        self.fused = fused_model(models[0], self.fused_state)
        self.template = copy.deepcopy(models[0])  # the module functional_call runs with each member's tensors
        for name, mod in list(self.template.named_modules()):
            if type(mod) is nn.Dropout:
                _set_tensor_module(self.template, name, MemberDropout(mod.p, self.lanes))
        self.members = models
        self.stacked: dict[str, torch.Tensor] = {}
        for name, p in models[0].named_parameters():
            rows = torch.stack([m.get_parameter(name).detach() for m in models])
            self.stacked[name] = rows.requires_grad_(p.requires_grad)
            for k, m in enumerate(models):
                _set_tensor(m, name, nn.Parameter(rows.detach()[k], requires_grad=p.requires_grad), "_parameters")
        self.stacked_buffers: dict[str, torch.Tensor] = {}
        for name, _ in models[0].named_buffers():
            rows = torch.stack([m.get_buffer(name) for m in models])
            self.stacked_buffers[name] = rows
            for k, m in enumerate(models):
                _set_tensor(m, name, rows[k], "_buffers")
        self.loss_vmapped = True  # False once the task's loss turned out not to run under vmap

    @property
    def layout(self) -> str:
        """How the members run: :data:`GROUPED` (one model, members side by side) or :data:`VMAP`."""
        return GROUPED if self.fused is not None else VMAP

    def forward(self, x: torch.Tensor, live: list[int], per_member: bool = False) -> torch.Tensor:
        self.lanes.live = live
        everyone = len(live) == len(self.members)
        index = None if everyone else torch.tensor(live, device=x.device)
        params = {n: t if index is None else t.index_select(0, index) for n, t in self.stacked.items()}
        buffers = {n: t if index is None else t.index_select(0, index) for n, t in self.stacked_buffers.items()}

        if self.fused is not None:
            out = self._fused_forward(self.fused, params, buffers, live, x, per_member)
        else:
            def one(p: dict, b: dict, lane: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
                self.lanes.lane = lane
                return functional_call(self.template, (p, b), (inputs,))

            lanes = torch.arange(len(live), device=x.device)
            out = vmap(one, in_dims=(0, 0, 0, 0 if per_member else None), randomness="same")(params, buffers, lanes, x)
        if index is not None and self.training:  # the live members' running statistics, back into their rows
            for name, t in self.stacked_buffers.items():
                t.index_copy_(0, index, buffers[name])
        return out

    def _fused_forward(self, fused: nn.Module, params: dict, buffers: dict, live: list[int], x: torch.Tensor,
                       per_member: bool) -> torch.Tensor:
        state = self.fused_state
        state.params, state.buffers, state.members = params, buffers, len(live)
        state.generators = [self.lanes.generators[k] for k in live]
        return from_fused(fused(to_fused(x, len(live), per_member)), len(live))

    def losses(self, criterion: Callable, outputs: torch.Tensor, y: torch.Tensor, per_member: bool) -> torch.Tensor:
        """Each live member's loss (``[L]``): the task's loss under vmap, or lane by lane when it
        cannot run there (data-dependent Python, ``.item()``)."""
        if self.loss_vmapped:
            try:
                return vmap(criterion, in_dims=(0, 0 if per_member else None))(outputs, y)
            except Exception:  # noqa: BLE001 - any refusal of vmap: the loop below gives the same values
                self.loss_vmapped = False
        return torch.stack([criterion(o, y[k] if per_member else y) for k, o in enumerate(outputs)])

    def release(self, k: int) -> nn.Module:
        """Member ``k``'s model with tensors of its own (copies of its rows), once it has left:
        what the population does afterwards no longer touches it, and its checkpoints, copies and
        exports hold only its own weights."""
        model = self.members[k]
        with torch.no_grad():
            for name, p in list(model.named_parameters()):
                _set_tensor(model, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad), "_parameters")
            for name, b in list(model.named_buffers()):
                _set_tensor(model, name, b.clone(), "_buffers")
        return model


def _set_tensor_module(root: nn.Module, name: str, module: nn.Module) -> None:
    prefix, _, leaf = name.rpartition(".")
    owner = root.get_submodule(prefix) if prefix else root
    setattr(owner, leaf, module)


def pack_models(models: list[nn.Module], generators: list[torch.Generator], loader, criterion: Callable) -> Population:
    """The members' models stacked into a Population, checked on the first training batch; PackError
    says why they cannot be."""
    problem = model_problem(models)
    if problem:
        raise PackError(problem)
    population = Population(models, generators)
    _, (x, y) = next(iter(loader.epoch(1, 0)))
    device = next(models[0].parameters()).device
    problem = probe_problem(population, x.to(device), y.to(device), criterion)
    if problem:
        raise PackError(problem)
    return population


def probe_problem(population: Population, x: torch.Tensor, y: torch.Tensor, criterion: Callable) -> str | None:
    """Why the population's forward cannot run under vmap, or None. Run on a batch with copies of
    the buffers and no gradient, in training mode with ``randomness="error"``: a random operation
    other than ``nn.Dropout`` (whose masks would then be the same for every member) is refused."""
    live = list(range(len(population.members)))
    population.lanes.live, population.lanes.quiet = live, True
    buffers = {n: t.clone() for n, t in population.stacked_buffers.items()}
    was_training = population.training
    population.train()

    def one(p: dict, b: dict, inputs: torch.Tensor) -> torch.Tensor:
        return functional_call(population.template, (p, b), (inputs,))

    try:
        with torch.no_grad():
            params = {n: t.detach() for n, t in population.stacked.items()}
            out = vmap(one, in_dims=(0, 0, None), randomness="error")(params, buffers, x)
            population.losses(criterion, out, y, per_member=False)
            if population.fused is not None and not _fused_agrees(population, population.fused, one, params, x):
                population.fused = None
    except Exception as exc:  # noqa: BLE001 - whatever vmap refuses, the members run alone
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return f"the model does not run under torch.func.vmap ({type(exc).__name__}: {text})"
    finally:
        population.lanes.quiet = population.fused_state.quiet = False
        population.train(was_training)
    return None


def _fused_agrees(population: Population, fused: nn.Module, one: Callable, params: dict, x: torch.Tensor) -> bool:
    """Whether the fused model gives what ``vmap`` of the probe's ``one`` gives on its batch, in
    training and in evaluation mode: not where the model's own forward mixes the members'
    channels (a concatenation of feature maps), in either mode."""
    live = list(range(len(population.members)))
    population.fused_state.quiet = True
    try:
        for training in (True, False):
            population.train(training)
            copies = {n: t.clone() for n, t in population.stacked_buffers.items()}
            expected = vmap(one, in_dims=(0, 0, None), randomness="error")(params, copies, x)
            copies = {n: t.clone() for n, t in population.stacked_buffers.items()}
            got = population._fused_forward(fused, params, copies, live, x, per_member=False)
            scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
            if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * scale):
                return False
    except Exception:  # noqa: BLE001 - a layout the fused layers cannot take: vmap runs the model
        return False
    return True


class StackedGradients:
    """The population's gradients: one flat buffer holding every stacked parameter's ``.grad``
    (zeroed in one fill), each member's parameter ``.grad`` a view of its row. Norms and clipping
    are computed for all members at once, each against its own ``grad_clip``."""

    def __init__(self, population: Population, device: torch.device) -> None:
        self.population, self.device = population, device
        tensors = list(population.stacked.values())
        self.buffer = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
        self.grads: list[torch.Tensor] = []
        offset = 0
        for t in tensors:
            grad = self.buffer[offset:offset + t.numel()].view_as(t)
            t.grad = grad
            self.grads.append(grad.view(t.shape[0], -1))
            offset += t.numel()
        for k, member in enumerate(population.members):
            for (name, p) in member.named_parameters():
                p.grad = population.stacked[name].grad[k]  # type: ignore[index]  # set just above

    def attach(self) -> None:
        """Nothing to do: a population trains every parameter (a frozen backbone is refused)."""

    def before_backward(self) -> None:
        self.buffer.zero_()

    def after_step(self) -> None:
        return None

    def measure(self, limits: list[float | None], live: list[int]) -> list[float]:
        """Each live member's gradient norm before clipping; members with a limit are clipped to it
        (``clip_grad_norm_``'s factor ``limit / (norm + 1e-6)`` when it is below 1)."""
        sq = torch.stack([g.square().sum(1) for g in self.grads]).sum(0)
        norms = sq.sqrt().tolist()
        factors = torch.ones(len(norms), dtype=self.buffer.dtype, device=self.device)
        clip = False
        for k, limit in zip(live, limits, strict=True):
            if limit and math.isfinite(norms[k]):
                factor = limit / (norms[k] + 1e-6)
                if factor < 1.0:
                    factors[k], clip = factor, True
        if clip:
            for g in self.grads:
                g.mul_(factors.unsqueeze(1))
        return [norms[k] for k in live]


def stack_members(models: list[nn.Module], generators: list[torch.Generator], backbone: nn.Module | None, task: Task,
                  loader, criterion: Callable, device: torch.device, distributed: bool,
                  on_layout: LayoutHook | None = None) -> tuple[nn.Module, StepGradients | StackedGradients]:
    """The module the loop trains and the gradients it clears and measures: a plain run's model, or
    the members stacked into a Population (refused with PackError when they cannot be), whose
    layout ``on_layout`` hears before the first step."""
    if len(models) == 1:
        return models[0], StepGradients(list(models[0].parameters()), device, distributed=distributed)
    if backbone is not None or task.checkpoint_blocks:
        raise PackError("the task has a pretrained backbone or checkpointed blocks, which one run holds")
    population = pack_models(models, generators, loader, criterion)
    if on_layout is not None:
        on_layout(population.layout)
    return population, StackedGradients(population, device)
