"""What every peer script shares, written once as a user would: the digits data in memory, the
digits CNN, the spec's sampler, one epoch of SGD with OneCycle and gradient clipping, validation.

The model and the split are the project's own (``core.tasks.digits``: same architecture, same
stratified split, read from the same cache ``sweeps`` uses), so every arm trains the same thing.
The batches are sliced from in-memory tensors (no DataLoader: for a 1,437-image tensor it only adds
per-batch Python work), and the per-step losses are read once per epoch, not with ``.item()`` per step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import optuna
import torch
from torch import nn

from core.tasks.digits import DigitsTask, load_split
from core.tasks.digits_models import DigitsCNN


def study_config(path: str) -> dict:
    """The study the peer runs: the JSON file bench_peers writes (see its ``peer_study``)."""
    return json.loads(Path(path).read_text())


def sampler(study: dict, constant_liar: bool = False) -> optuna.samplers.BaseSampler:
    """The spec's sampler (TPE or Optuna's GP), its seed and start-up trials: every arm searches
    alike. Optuna's GP sampler has no constant-liar option (it fits completed trials only)."""
    if study["sampler"] == "gp":
        return optuna.samplers.GPSampler(seed=study["seed"], n_startup_trials=study["n_startup_trials"])
    return optuna.samplers.TPESampler(seed=study["seed"], n_startup_trials=study["n_startup_trials"],
                                      constant_liar=constant_liar)


def load_data(val_fraction: float) -> tuple[torch.Tensor, ...]:
    """``(x_train, y_train, x_val, y_val)``: the digits task's split, preprocessed to [-1, 1]."""
    images, labels, idx_train, idx_val = load_split(val_fraction, 0)
    x = DigitsTask().preprocess(torch.from_numpy(images))
    y = torch.from_numpy(labels)
    return x[idx_train], y[idx_train], x[idx_val], y[idx_val]


@dataclass
class Training:
    """One trial's model, optimizer and OneCycle schedule, as ``sweeps`` configures them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.OneCycleLR
    batch_size: int
    grad_clip: float

    @classmethod
    def create(cls, study: dict, lr: float, batch_size: int, n_train: int) -> Training:
        torch.manual_seed(study["seed"])
        model = DigitsCNN(width=study["width"])
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=study["momentum"],
                                    weight_decay=study["weight_decay"])
        steps = -(-n_train // batch_size) * study["epochs"]
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
        return cls(model, optimizer, scheduler, batch_size, study["grad_clip"])

    def train_epoch(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """One shuffled pass; returns the loss of every step."""
        self.model.train()
        losses = []
        order = torch.randperm(len(x))
        for start in range(0, len(x), self.batch_size):
            idx = order[start:start + self.batch_size]
            loss = nn.functional.cross_entropy(self.model(x[idx]), y[idx])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            losses.append(loss.detach())
        return torch.stack(losses).tolist()

    @torch.inference_mode()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        self.model.eval()
        logits = self.model(x)
        return {"val_loss": nn.functional.cross_entropy(logits, y).item(),
                "val_acc": (logits.argmax(1) == y).float().mean().item()}

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]
