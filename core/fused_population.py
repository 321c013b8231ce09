"""A population's members as one model of grouped layers, for models built only of the layers
below (HFTA, MLSys 2021): the members' tensors side by side in the channel dimension
(``[batch, members x channels, ...]``), each convolution one grouped convolution, each batch norm
one over every member's channels, each linear layer one batched matrix product; activations,
pooling and flattening act on that layout as they are. ``vmap`` runs the same model with a copy
before each batch norm and pooling layer, which on a CPU makes a population of a few small CNNs
slower than its members one after another; this layout needs none.

Each layer reads the members' stacked tensors at call time (:class:`FusedState`, filled by
``Population.forward``), so gradients reach the population's stacked parameters and running
statistics update its stacked buffers, as under ``vmap``. The model's own ``forward`` runs
unchanged, so a model that mixes the channel dimension in it (a U-Net's ``torch.cat`` of feature
maps) computes something else: the population compares both on its first batch and keeps
``vmap`` unless they agree (core/population.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# Layers that act on each channel alone, so on the fused layout as on one member's.
CHANNELWISE = (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.ELU, nn.Tanh, nn.Sigmoid, nn.Identity,
               nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
               nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


@dataclass
class FusedState:
    """What the fused layers read during one forward pass: the live members' stacked parameters
    and buffers by name (``[members, ...]``), how many members, their dropout generators."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    members: int = 0
    generators: list[torch.Generator] = field(default_factory=list)
    quiet: bool = False  # a probe: dropout draws nothing


class _Fused(nn.Module):
    """A layer of the fused model: ``name`` is the layer's path in the member's model."""

    def __init__(self, name: str, layer: nn.Module, state: FusedState) -> None:
        super().__init__()
        self.name, self.state = name, state
        self.settings = {k: v for k, v in vars(layer).items() if not k.startswith("_") and k != "training"}

    def _param(self, leaf: str) -> torch.Tensor | None:
        return self.state.params.get(f"{self.name}.{leaf}")

    def _weight(self) -> torch.Tensor:
        return self.state.params[f"{self.name}.weight"]

    def _buffer(self, leaf: str) -> torch.Tensor | None:
        return self.state.buffers.get(f"{self.name}.{leaf}")


class FusedConv(_Fused):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, weight, bias = self.settings, self._weight(), self._param("bias")
        k = self.state.members
        conv = F.conv1d if weight.dim() == 4 else F.conv2d
        return conv(x, weight.reshape(k * weight.shape[1], *weight.shape[2:]),
                    None if bias is None else bias.reshape(-1), s["stride"], s["padding"], s["dilation"],
                    s["groups"] * k)


class FusedBatchNorm(_Fused):
    """``nn.BatchNorm1d``/``2d`` with a momentum, as the module computes it, over every member's
    channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.settings
        mean, var, tracked = self._buffer("running_mean"), self._buffer("running_var"), \
            self._buffer("num_batches_tracked")
        factor = s["momentum"]  # not None: _fused_layer leaves such a norm to vmap
        if self.training and s["track_running_stats"] and tracked is not None:
            tracked.add_(1)
        use_stats = not self.training or s["track_running_stats"]
        weight, bias = self._param("weight"), self._param("bias")
        return F.batch_norm(x, mean.view(-1) if use_stats and mean is not None else None,
                            var.view(-1) if use_stats and var is not None else None,
                            None if weight is None else weight.reshape(-1), None if bias is None else bias.reshape(-1),
                            self.training or (mean is None and var is None), factor, s["eps"])


class FusedLinear(_Fused):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("a fused linear layer takes [batch, members x features]")
        weight, bias = self._weight(), self._param("bias")  # [members, out, in], [members, out]
        k = self.state.members
        lanes = x.reshape(x.shape[0], k, -1).transpose(0, 1)  # [members, batch, in]
        out = torch.bmm(lanes, weight.transpose(1, 2)) if bias is None else \
            torch.baddbmm(bias.unsqueeze(1), lanes, weight.transpose(1, 2))
        return out.transpose(0, 1).reshape(x.shape[0], -1)


class FusedDropout(_Fused):
    """Each member's mask from its own generator, drawn on a tensor of the shape it has alone, as
    ``MemberDropout`` draws it under ``vmap`` (core/population.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.settings["p"]
        if not self.training or p == 0 or self.state.quiet:
            return x
        k = self.state.members
        alone = (x.shape[0], x.shape[1] // k, *x.shape[2:])
        masks = torch.stack([torch.empty(alone, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=g)
                             for g in self.state.generators])
        masks.div_(1 - p)
        return x * masks.movedim(0, 1).reshape(x.shape)


def _fused_layer(layer: nn.Module) -> type[_Fused] | None:
    if type(layer) in (nn.Conv1d, nn.Conv2d) and layer.padding_mode == "zeros":
        return FusedConv
    if type(layer) in (nn.BatchNorm1d, nn.BatchNorm2d) and layer.momentum is not None:
        return FusedBatchNorm  # momentum None: a cumulative average over each member's own count
    if type(layer) is nn.Linear:
        return FusedLinear
    if type(layer) is nn.Dropout:
        return FusedDropout
    return None


def fused_model(template: nn.Module, state: FusedState) -> nn.Module | None:
    """A copy of ``template`` whose layers act on the fused layout, or None when one of its layers
    is not one this module knows (a custom layer, a flatten that does not start at the channels)
    or a module other than those layers holds a tensor of its own."""
    model = copy.deepcopy(template)
    for name, layer in list(model.named_modules()):
        fused = _fused_layer(layer)
        if fused is not None and name:
            prefix, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(prefix) if prefix else model, leaf, fused(name, layer, state))
        elif any(True for _ in layer.children()):  # its forward composes its layers: the probe checks how
            if any(True for _ in layer.parameters(recurse=False)) or any(True for _ in layer.buffers(recurse=False)):
                return None
        elif type(layer) is nn.Flatten:
            if layer.start_dim != 1 or layer.end_dim != -1:
                return None
        elif type(layer) not in CHANNELWISE:
            return None
    return model


def to_fused(x: torch.Tensor, members: int, per_member: bool) -> torch.Tensor:
    """The members' inputs (``[members, batch, ...]``, or one batch for all) side by side in the
    channel dimension: ``[batch, members x channels, ...]``."""
    if not per_member:
        x = x.unsqueeze(0).expand(members, *x.shape)
    return x.movedim(0, 1).reshape(x.shape[1], members * x.shape[2], *x.shape[3:])


def from_fused(out: torch.Tensor, members: int) -> torch.Tensor:
    """The fused model's output as the members' outputs stacked: ``[members, batch, ...]``."""
    return out.reshape(out.shape[0], members, out.shape[1] // members, *out.shape[2:]).movedim(1, 0)
