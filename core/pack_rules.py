"""Which runs may train as one population (core/population.py), decided from their configs alone:
no torch is imported here, so ``sweeps validate`` can say it before any trial starts."""
from __future__ import annotations

from core.config import TrainConfig

# The TrainConfig fields members of one population may differ in: their optimizer, its schedule,
# clipping and the seed (initialisation, dropout and data order). Everything else is shared.
MEMBER_FIELDS = frozenset({
    "lr", "optimizer", "momentum", "nesterov", "weight_decay", "adam_beta1", "adam_beta2", "scheduler",
    "warmup_epochs", "onecycle_pct_start", "onecycle_div_factor", "onecycle_final_div_factor",
    "cosine_min_lr_ratio", "step_size_epochs", "step_gamma", "plateau_factor", "plateau_patience",
    "grad_clip", "seed",
})


def config_problem(cfgs: list[TrainConfig]) -> str | None:
    """Why these configs cannot train as one population, or None: settings a population cannot
    give each member (DDP, the profiler, torch.compile, mixup, fp16 loss scaling) or shared
    settings that differ (only ``MEMBER_FIELDS`` may)."""
    first = cfgs[0]
    for cfg in cfgs:
        if cfg.distributed.nproc > 1:
            return "train.distributed.nproc > 1 (DDP) trains one run over several processes"
        if cfg.profile is not None:
            return "train.profile traces one run's steps"
        if cfg.compile:
            return "train.compile compiles one model"
        if cfg.mixup_alpha > 0:
            return "train.mixup_alpha draws one mixing per batch from the shared random stream"
        if cfg.precision == "fp16":
            return "train.precision fp16 scales one loss with one GradScaler"
    shared = {k: v for k, v in first.to_dict().items() if k not in MEMBER_FIELDS}
    for cfg in cfgs[1:]:
        for key, value in cfg.to_dict().items():
            if key not in MEMBER_FIELDS and shared[key] != value:
                return (f"train.{key} differs ({shared[key]!r} and {value!r}); members may differ only in "
                        f"{', '.join(sorted(MEMBER_FIELDS))}")
    return None
