"""The shapes task's fully convolutional models: an image (N, 3, H, W) in, per-pixel class logits
(N, classes, H, W) out, for any H and W divisible by 4 (a module of its own so that naming and
checking the task, as spec validation does, does not import torch)."""
from __future__ import annotations

import torch
from torch import nn


def _block(c_in: int, c_out: int, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU())


class TinyUNet(nn.Module):
    """Two downsamplings (H -> H/2 -> H/4) and back, with skip connections; about 26k parameters
    at width 8, 100k at width 16."""

    def __init__(self, width: int = 16, num_classes: int = 4, in_channels: int = 3) -> None:
        super().__init__()
        w = width
        self.enc1 = nn.Sequential(_block(in_channels, w), _block(w, w))
        self.enc2 = nn.Sequential(_block(w, 2 * w), _block(2 * w, 2 * w))
        self.mid = _block(2 * w, 4 * w)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec2 = _block(4 * w + 2 * w, 2 * w)
        self.dec1 = _block(2 * w + w, w)
        self.head = nn.Conv2d(w, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        m = self.mid(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up(d2), e1], dim=1))
        return self.head(d1)


class DilatedFCN(nn.Module):
    """Full resolution throughout: 3x3 convolutions dilated 1, 2, 4, 1 (a 17-pixel receptive field)."""

    def __init__(self, width: int = 16, num_classes: int = 4, in_channels: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(_block(in_channels, width), _block(width, width, 2), _block(width, width, 4),
                                  _block(width, width), nn.Conv2d(width, num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
