"""DDP helpers for the one training loop. Single-process runs use the same code with
world_size 1, where every collective is a no-op."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.reporting import Decision

_DECISIONS = list(Decision)  # index <-> decision, for broadcasting


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, values: list[float], device: torch.device) -> list[float]:
        """Sum plain numbers over ranks (a CPU-GPU sync point; called once per epoch)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def broadcast_int(self, value: int, device: torch.device) -> int:
        """Rank 0's value on every rank: how a pruning or interrupt decision reaches all ranks,
        so no rank is left waiting in a collective that the others have abandoned."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def agree(self, decision: Decision, device: torch.device) -> Decision:
        """Rank 0's decision (its reporter's; the other ranks hold a NullReporter) on every rank."""
        if not self.enabled:
            return decision
        return _DECISIONS[self.broadcast_int(_DECISIONS.index(decision), device)]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def resolve_backend(setting: str = "auto", device_setting: str = "auto") -> str:
    """``auto`` -> NCCL when the run trains on CUDA, gloo otherwise (a CPU run on a GPU machine
    still needs gloo: NCCL cannot reduce CPU tensors)."""
    if setting != "auto":
        return setting
    on_cuda = device_setting.startswith("cuda") or (device_setting == "auto" and torch.cuda.is_available())
    return "nccl" if on_cuda else "gloo"


def lr_scale_factor(rule: str, world_size: int) -> float:
    """Learning-rate multiplier for ``world_size`` processes: the global batch grows with the
    world size, so ``linear`` (usual for SGD) multiplies by N and ``sqrt`` (usual for Adam) by sqrt(N)."""
    if rule == "linear":
        return float(world_size)
    if rule == "sqrt":
        return math.sqrt(world_size)
    return 1.0


def init_from_env(backend_setting: str = "auto", device_setting: str = "auto") -> DistContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT; ``core.ddp_launch`` sets the same variables). Without
    those variables this is a 1-process context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = resolve_backend(backend_setting, device_setting)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend)


def shutdown(ctx: DistContext, completed: bool = False) -> None:
    """Leave the process group. After a normal end every rank first meets at a barrier, so no
    rank tears its connections down while another still uses them; after an error there is no
    barrier (a dead peer would never arrive; the launcher ends the other ranks)."""
    if ctx.enabled and dist.is_initialized():
        if completed:
            dist.barrier()
        dist.destroy_process_group()
