"""Tasks for tests/core/test_ddp.py. They live in a module of their own because every DDP rank
unpickles them, i.e. imports this module (not the test module and its fixtures).

Each task records its rank's pid (so a test can prove no rank outlived the trial) and can
crash one rank at a given training micro-step or count the gradient all-reduces DDP runs.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from core.tasks import task
from core.tasks.synthetic import SyntheticTask


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Faulty(nn.Module):
    """Wraps a model; on ``fail_rank`` the ``fail_at``-th training forward exits or raises."""

    def __init__(self, inner: nn.Module, fail_rank: int, fail_at: int, mode: str) -> None:
        super().__init__()
        self.inner, self.fail_rank, self.fail_at, self.mode = inner, fail_rank, fail_at, mode
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and _rank() == self.fail_rank:
            self.calls += 1
            if self.calls == self.fail_at:
                if self.mode == "exit":
                    os._exit(3)  # a hard death: no exception, no message
                raise RuntimeError(f"boom on rank {self.fail_rank} at micro-step {self.calls}")
        return self.inner(x)


class DdpTestTask(SyntheticTask):
    """A synthetic MLP (no dropout, no BatchNorm) with test instrumentation."""

    def __init__(self, pid_dir: str, fail_rank: int | None = None, fail_at: int = 3, fail_mode: str = "raise",
                 comm_log: str | None = None, **kwargs) -> None:
        kwargs.setdefault("model", "mlp")
        kwargs.setdefault("shape", (16,))
        kwargs.setdefault("n_train", 256)
        kwargs.setdefault("n_val", 64)
        super().__init__(**kwargs)
        self.pid_dir, self.fail_rank, self.fail_at, self.fail_mode = pid_dir, fail_rank, fail_at, fail_mode
        self.comm_log = comm_log

    def build_model(self) -> nn.Module:
        Path(self.pid_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.pid_dir) / f"rank{_rank()}.pid").write_text(str(os.getpid()))
        if self.comm_log is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _count_allreduces_in_this_process(Path(self.comm_log) / f"rank{_rank()}.log")
        model = super().build_model()
        if self.fail_rank is not None:
            model = _Faulty(model, self.fail_rank, self.fail_at, self.fail_mode)
        return model


def _count_allreduces_in_this_process(log: Path) -> None:
    """Make every DDP wrapper built in this (rank) process run a comm hook that logs one line per
    gradient bucket it all-reduces, then does the default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_cls = nn.parallel.DistributedDataParallel
    original_init = ddp_cls.__init__

    def hook(state, bucket):
        with open(state, "a") as fh:
            fh.write(f"{bucket.index()}\n")
        return default_hooks.allreduce_hook(None, bucket)

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.register_comm_hook(str(log), hook)

    ddp_cls.__init__ = init


@task
def make_ddp_test_task(pid_dir: str, fail_rank: int | None = None, fail_at: int = 3, fail_mode: str = "raise",
                       model: str = "mlp") -> DdpTestTask:
    """``task.target: tests.core.ddp_tasks:make_ddp_test_task`` for sweep-level tests."""
    return DdpTestTask(pid_dir, fail_rank=fail_rank, fail_at=fail_at, fail_mode=fail_mode, model=model)
