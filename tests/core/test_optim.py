"""core.optim.build_optimizer: fused kernels on CPU, training as PyTorch's default implementation does."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.config import TrainConfig
from core.optim import build_optimizer, param_groups

SETTINGS = {
    "sgd": {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 5e-4},
    "sgd nesterov": {"optimizer": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4},
    "adam": {"optimizer": "adam", "weight_decay": 1e-4},
    "adamw": {"optimizer": "adamw", "weight_decay": 1e-2},
}
DEFAULT_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def _reference(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The same optimizer in PyTorch's default (per-tensor, not fused) implementation."""
    groups = param_groups(model, cfg, model[0])  # two groups: the backbone at a lower lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, foreach=False)
    return DEFAULT_CLASSES[cfg.optimizer](groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                          weight_decay=cfg.weight_decay, foreach=False)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_cpu_optimizers_are_fused_and_train_as_the_default_implementation(name):
    cfg = TrainConfig(lr=0.05, backbone_lr_mult=0.1, **SETTINGS[name])
    ours, theirs = _model(), _model()
    opt = build_optimizer(param_groups(ours, cfg, ours[0]), cfg)
    ref = _reference(theirs, cfg)
    assert opt.defaults["fused"] is True and type(opt) is type(ref)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        for model, optimizer in ((ours, opt), (theirs, ref)):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    # it trained
    assert any((a - b).abs().max() > 0 for a, b in zip(ours.parameters(), _model().parameters(), strict=True))


def test_a_parameter_type_without_a_fused_kernel_gets_the_default_implementation():
    cfg = TrainConfig(lr=0.1, optimizer="sgd", momentum=0.9)
    weights = [nn.Parameter(torch.zeros(3, dtype=torch.complex64))]  # no fused kernel for complex
    opt = build_optimizer([{"params": weights, "lr": 0.1, "name": "all"}], cfg)
    assert not opt.defaults.get("fused")
    weights[0].grad = torch.ones(3, dtype=torch.complex64)
    opt.step()
    assert torch.allclose(weights[0], torch.full((3,), -0.1, dtype=torch.complex64))
