"""TrainConfig: every training default in one typed place.

A study spec's ``train:`` section and the sampled ``search:`` values are applied
onto a TrainConfig with :func:`apply_overrides`; an unknown field is an error, never
silently ignored. The resolved config is stored in every checkpoint and logged by
the tracker, so a run can be rebuilt exactly (``sweeps rerun``).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

Optimizer = Literal["sgd", "adam", "adamw"]
Scheduler = Literal["onecycle", "cosine", "step", "plateau", "constant"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
LrScaleRule = Literal["none", "linear", "sqrt"]
SuggestRule = Literal["steepest", "valley", "minimum"]


class ConfigError(ValueError):
    """A config field or value is invalid; the message names the field, the value and the fix."""


@dataclass
class DistributedConfig:
    """DDP inside one trial. ``nproc == 1`` means a plain single-process run."""

    nproc: int = 1
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: NCCL on CUDA, gloo on CPU
    lr_scale_rule: LrScaleRule = "none"  # linear for SGD, sqrt for Adam; off by default
    sync_batchnorm: bool = False


@dataclass
class ProfileConfig:
    """``train.profile``: torch.profiler over a few optimizer steps (core/profiling.py). Steps
    ``wait`` are skipped, ``warmup`` traced and dropped, ``active`` recorded; ``repeat`` cycles."""

    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = False  # Python stacks per op: large traces, slower


@dataclass
class TrainConfig:
    """Every knob of :func:`core.train.train`. Defaults are sensible for small CPU runs."""

    # -- loop
    epochs: int = 10
    batch_size: int = 32  # per process under DDP; the global batch is reported
    max_steps_per_epoch: int | None = None  # cap micro-batches per epoch (benchmarks, smoke runs)
    # -- optimizer
    lr: float = 0.01
    optimizer: Optimizer = "sgd"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    backbone_lr_mult: float = 1.0  # lr multiplier for a pretrained backbone's parameter group
    freeze_backbone_epochs: int = 0  # train only the head for the first N epochs
    # -- schedule
    scheduler: Scheduler = "constant"
    warmup_epochs: float = 0.0  # linear warmup (cosine); OneCycle uses pct_start instead
    onecycle_pct_start: float = 0.3
    onecycle_div_factor: float = 25.0
    onecycle_final_div_factor: float = 1.0e4
    cosine_min_lr_ratio: float = 0.0
    step_size_epochs: int = 30
    step_gamma: float = 0.1
    plateau_factor: float = 0.1
    plateau_patience: int = 2
    # -- numerics
    precision: Precision = "auto"  # auto: bf16 on CUDA with bf16 support, else fp32
    grad_accum_steps: int = 1
    grad_clip: float | None = None  # max global grad norm; None or 0 disables clipping
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0  # 0 disables mixup
    compile: bool = False  # torch.compile the model
    # -- diagnostics (all off by default; core/forensics.py)
    detect_anomaly: bool = False  # on divergence, replay the step under torch.autograd.detect_anomaly
    # -- reproducibility
    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms + cuDNN flags
    # -- data loading
    num_workers: int = -1  # -1: about half the CPU threads this process may use; 0 loads in-process
    prefetch_factor: int = 2
    pin_memory: bool = True  # page-locked batches for faster host->GPU copies; ignored on CPU
    # -- device
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # -- outputs
    monitor: str = "val_loss"  # metric that decides the best checkpoint and the plateau scheduler
    monitor_mode: Literal["min", "max"] = "min"
    save_checkpoints: bool = True
    # Epochs between resumable checkpoints (last.pt): 1 writes one after every epoch. A run killed
    # between two resumes from the earlier one and trains the epochs after it again. The final
    # epoch and any stop that says "checkpoint saved" (a signal, a stop at an epoch's end) write one.
    checkpoint_every: int = 1
    export_onnx: bool = False
    onnx_tolerance: float = 1.0e-4  # also the TorchScript check's
    # model.ts beside model.onnx (core/torchscript_export.py)
    export_torchscript: Literal["trace", "script"] | None = None
    # -- distributed
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # -- diagnostics: a mapping (``{}`` for the defaults) profiles a few steps; null: off
    profile: ProfileConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return apply_overrides(cls(), data)


def config_fields() -> dict[str, Any]:
    """Name -> type hint of every TrainConfig field (the keys a spec may set or search)."""
    return get_type_hints(TrainConfig)


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Check ``value`` against the field's type hint; ints are accepted for floats."""
    origin_args = get_args(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"train.{name}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"train.{name}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"train.{name}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"train.{name}: expected a string, got {value!r}")
    if getattr(hint, "__origin__", None) is Literal:
        if value in origin_args:
            return value
        allowed = ", ".join(map(str, origin_args))
        raise ConfigError(f"train.{name}: {value!r} is not one of {allowed}")
    if type(None) in origin_args:  # Optional[X]
        if value is None:
            return None
        inner = next(a for a in origin_args if a is not type(None))
        return _coerce(name, inner, value)
    return value


_SECTIONS: dict[str, type] = {"distributed": DistributedConfig, "profile": ProfileConfig}  # nested mappings
_OPTIONAL_SECTIONS = ("profile",)  # null turns them off


def _section(key: str, current: Any, value: Any) -> Any:
    """A nested section (``train.distributed``, ``train.profile``) from a mapping, on top of its
    current values (or its defaults)."""
    cls = _SECTIONS[key]
    if isinstance(value, cls):
        return value
    if value is None and key in _OPTIONAL_SECTIONS:
        return None
    if not isinstance(value, dict):
        null = " (or null to turn it off)" if key in _OPTIONAL_SECTIONS else ""
        raise ConfigError(f"train.{key}: expected a mapping{null}, got {value!r}")
    hints = get_type_hints(cls)
    values = dataclasses.asdict(current) if current is not None else dataclasses.asdict(cls())
    for k, v in value.items():
        if k not in hints:
            raise ConfigError(f"train.{key}.{k}: unknown field.{_did_you_mean(k, list(hints))}")
        values[k] = _coerce(f"{key}.{k}", hints[k], v)
    return cls(**values)


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Return a copy of ``cfg`` with ``overrides`` applied; unknown keys raise ConfigError."""
    hints = config_fields()
    updates: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in hints:
            raise ConfigError(
                f"train.{key}: unknown train-config field.{_did_you_mean(key, list(hints))}"
            )
        if key in _SECTIONS:
            updates[key] = _section(key, getattr(cfg, key), value)
            continue
        updates[key] = _coerce(key, hints[key], value)
    new = dataclasses.replace(cfg, **updates)
    validate(new)
    return new


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that a type hint cannot express."""
    checks = [
        (cfg.epochs >= 1, "epochs", cfg.epochs, "use 1 or more"),
        (cfg.batch_size >= 1, "batch_size", cfg.batch_size, "use 1 or more"),
        (cfg.lr > 0, "lr", cfg.lr, "use a positive learning rate"),
        (cfg.grad_accum_steps >= 1, "grad_accum_steps", cfg.grad_accum_steps, "use 1 or more"),
        (cfg.checkpoint_every >= 1, "checkpoint_every", cfg.checkpoint_every, "use 1 (every epoch) or more epochs"),
        (cfg.weight_decay >= 0, "weight_decay", cfg.weight_decay, "use 0 or more"),
        (0 <= cfg.label_smoothing < 1, "label_smoothing", cfg.label_smoothing, "use [0, 1)"),
        (cfg.mixup_alpha >= 0, "mixup_alpha", cfg.mixup_alpha, "use 0 (off) or more"),
        (cfg.warmup_epochs >= 0, "warmup_epochs", cfg.warmup_epochs, "use 0 or more"),
        (0 < cfg.onecycle_pct_start < 1, "onecycle_pct_start", cfg.onecycle_pct_start, "use (0, 1)"),
        (cfg.num_workers >= -1, "num_workers", cfg.num_workers, "use -1 (auto), 0 or more"),
        (cfg.distributed.nproc >= 1, "distributed.nproc", cfg.distributed.nproc, "use 1 or more"),
        (cfg.grad_clip is None or cfg.grad_clip >= 0, "grad_clip", cfg.grad_clip, "use a positive norm or null"),
        (cfg.max_steps_per_epoch is None or cfg.max_steps_per_epoch >= 1,
         "max_steps_per_epoch", cfg.max_steps_per_epoch, "use 1 or more, or null"),
    ]
    if cfg.profile is not None:
        p = cfg.profile
        checks += [(p.wait >= 0, "profile.wait", p.wait, "use 0 or more steps"),
                   (p.warmup >= 0, "profile.warmup", p.warmup, "use 0 or more steps"),
                   (p.active >= 1, "profile.active", p.active, "use 1 or more steps"),
                   (p.repeat >= 1, "profile.repeat", p.repeat, "use 1 or more cycles")]
    for ok, name, value, fix in checks:
        if not ok:
            raise ConfigError(f"train.{name}: {value!r} is out of range; {fix}")
