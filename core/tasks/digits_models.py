"""The digits task's models (a module of its own so that naming and checking the task, as spec
validation does, does not import torch)."""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """``depth`` 3x3 conv blocks (default two: about 20k parameters at width 16) and a linear head.
    Channels: width for every block but the last, which has 2 * width; depth 2 is the original
    model, layer for layer (its checkpoints load unchanged)."""

    def __init__(self, width: int = 16, dropout: float = 0.1, num_classes: int = 10, depth: int = 2) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"task.args.depth: {depth!r} must be >= 1")
        channels = [1] + [width] * (depth - 1) + [2 * width]
        layers: list[nn.Module] = []
        for c_in, c_out in zip(channels, channels[1:], strict=False):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
        self.features = nn.Sequential(*layers, nn.MaxPool2d(2))  # 8x8 -> 4x4
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * 16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsMLP(nn.Module):
    def __init__(self, width: int = 64, dropout: float = 0.1, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
