"""The search space: the one place that knows what a ``search:`` entry means.

A spec's ``search:`` maps a key (a TrainConfig field such as ``lr``, or ``task.<arg>``)
to one parameter. This module holds the parameter models, the rules a parameter must
follow, and its translation for each backend, so Optuna, Ray and the grid samplers
all draw from the same set of values:

- ``float``: ``[low, high]``; ``log: true`` samples log-uniformly (needs ``low > 0``);
  ``step`` samples ``low, low + step, ..., high`` (``high - low`` must be a multiple of
  ``step``: Optuna would otherwise shrink ``high`` with only a warning).
- ``int``: ``[low, high]``, both ends included; ``step`` (default 1) as for float;
  ``log: true`` needs ``low >= 1``.
- ``categorical``: one of ``choices`` (strings, numbers, true/false or null).

``step`` and ``log`` together are refused (Optuna cannot quantize a log scale).
Ray is imported lazily: only the Ray backend pays for it.
"""
from __future__ import annotations

import math
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    import optuna

TASK_PREFIX = "task."  # search keys that are task arguments: task.width -> width=...
MAX_GRID_POINTS = 100_000  # the grid samplers enumerate the whole product up front
Problem = tuple[tuple[Any, ...], str]  # (field path, message); spec.py adds the path and the line


class _Param(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FloatParam(_Param):
    """A real number in ``[low, high]`` (both included)."""

    type: Literal["float"]
    low: float = Field(allow_inf_nan=False)
    high: float = Field(allow_inf_nan=False)
    log: bool = False
    step: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class IntParam(_Param):
    """An integer in ``[low, high]`` (both included); ``step`` None means 1."""

    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int | None = Field(default=None, ge=1)


class CategoricalParam(_Param):
    """One of ``choices``; order matters only to the grid samplers."""

    type: Literal["categorical"]
    choices: list[Any]

    @field_validator("choices")
    @classmethod
    def _scalars(cls, choices: list[Any]) -> list[Any]:
        # Optuna storages persist only these types; a list or mapping choice is refused.
        for i, value in enumerate(choices):
            if value is not None and not isinstance(value, (str, int, float, bool)):
                raise ValueError(f"choice [{i}] {value!r} is not a string, number, true/false or null")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"choice [{i}] {value!r} is not a finite number")
        return choices


SearchParam = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]
PARAM_TYPES = ("float", "int", "categorical")


def _dec(x: float) -> Decimal:
    # Via repr, so 0.1 is the decimal 0.1 the user wrote, not 0.1000000000000000055...
    return Decimal(repr(x))


def _is_multiple(value: float, step: float) -> bool:
    return _dec(value) % _dec(step) == 0


def _span(p: FloatParam | IntParam) -> Decimal:
    return _dec(p.high) - _dec(p.low)


def param_problems(key: str, p: FloatParam | IntParam | CategoricalParam, backend: str) -> list[Problem]:
    """The rules one parameter must follow (bounds, log, step, choices) under ``backend``."""
    at = ("search", key)
    out: list[Problem] = []
    if isinstance(p, CategoricalParam):
        if not p.choices:
            out.append((at + ("choices",), "[] is empty; give at least one choice"))
        for i, a in enumerate(p.choices):
            for b in p.choices[i + 1:]:
                if a == b and type(a) is type(b):
                    out.append((at + ("choices",), f"{a!r} is listed twice; list each choice once"))
        return out
    kind = "an int" if isinstance(p, IntParam) else "a float"
    if p.low > p.high:
        out.append((at + ("low",), f"{p.low!r} is above high {p.high!r}; use low <= high"))
    if p.log and p.step is not None:
        out.append((at, f"step {p.step!r} and log: true together; a log scale cannot be stepped, "
                        "remove step or set log: false"))
    if p.log and isinstance(p, FloatParam) and p.low <= 0:
        out.append((at + ("low",), f"{p.low!r} with log: true; a log scale needs low > 0 "
                                   "(e.g. 1.0e-6), or set log: false"))
    if p.log and isinstance(p, IntParam) and p.low < 1:
        out.append((at + ("low",), f"{p.low!r} with log: true; an int log scale needs low >= 1, or set log: false"))
    if p.step is not None and p.low <= p.high and _span(p) % _dec(p.step) != 0:
        out.append((at + ("step",), f"{p.step!r} does not divide high - low = {_span(p)}, so high "
                                    f"could never be drawn; make high - low a multiple of step for {kind}"))
    if backend == "ray" and p.step not in (None, 1) and not _is_multiple(p.low, p.step):
        # Ray quantizes to multiples of q counted from 0, Optuna from low: they agree only then.
        out.append((at + ("low",), f"{p.low!r} is not a multiple of step {p.step!r}; backend ray draws "
                                   "multiples of step, so use a low that is one"))
    return out


def grid_problems(search: dict[str, Any]) -> list[Problem]:
    """Why ``search`` has no finite grid for ``sampler: grid`` (empty when it has one)."""
    out: list[Problem] = []
    for key, p in search.items():
        if isinstance(p, FloatParam) and p.step is None:
            out.append((("search", key), "a float without step has no finite grid for sampler grid; "
                                         "add step, or use type: categorical with the values to try"))
    if not out:
        size = grid_size(search)
        if size > MAX_GRID_POINTS:
            out.append((("search",), f"the grid has {size} points (over {MAX_GRID_POINTS}); "
                                     "use larger steps or fewer choices"))
    return out


def _float_grid(p: FloatParam) -> list[float]:
    assert p.step is not None
    low, step = _dec(p.low), _dec(p.step)
    return [float(low + k * step) for k in range(int(_span(p) / step) + 1)]


def _values(p: FloatParam | IntParam | CategoricalParam) -> list[Any]:
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if isinstance(p, IntParam):
        return list(range(p.low, p.high + 1, p.step or 1))
    if p.step is None:
        raise ValueError("a float without step has no grid")
    return _float_grid(p)


def grid_size(search: dict[str, Any]) -> int:
    """Number of points in the grid of ``search``, without building it (ValueError if infinite)."""
    size = 1
    for p in search.values():
        if isinstance(p, CategoricalParam):
            size *= len(p.choices)
        elif isinstance(p, FloatParam) and p.step is None:
            raise ValueError("a float without step has no grid")
        else:
            size *= int(_span(p) / _dec(p.step or 1)) + 1
    return size


def grid_search_space(search: dict[str, Any]) -> dict[str, list[Any]]:
    """Every value of each parameter, for ``optuna.samplers.GridSampler`` (bounds included)."""
    return {key: _values(p) for key, p in search.items()}


def optuna_distributions(search: dict[str, Any]) -> dict[str, optuna.distributions.BaseDistribution]:
    """Optuna distributions of ``search`` (e.g. for ``study.enqueue_trial`` or ``ask(fixed_distributions)``)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for key, p in search.items():
        if isinstance(p, FloatParam):
            out[key] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            out[key] = IntDistribution(p.low, p.high, log=p.log, step=p.step or 1)
        else:
            out[key] = CategoricalDistribution(tuple(p.choices))
    return out


def suggest(trial: optuna.trial.BaseTrial, search: dict[str, Any]) -> dict[str, Any]:
    """Draw one value per parameter from an Optuna trial, in the spec's key order."""
    params: dict[str, Any] = {}
    for key, p in search.items():
        if isinstance(p, FloatParam):
            params[key] = trial.suggest_float(key, p.low, p.high, step=p.step, log=p.log)
        elif isinstance(p, IntParam):
            params[key] = trial.suggest_int(key, p.low, p.high, step=p.step or 1, log=p.log)
        else:
            params[key] = trial.suggest_categorical(key, list(p.choices))
    return params


def to_ray_space(search: dict[str, Any]) -> dict[str, Any]:
    """Ray Tune domains drawing the same values as Optuna would (both bounds included).

    Ray's ``randint``/``lograndint`` exclude the upper bound, so they get ``high + 1``;
    ``qrandint``/``quniform`` with ``q > 1`` include it and draw multiples of ``q``,
    which equal Optuna's ``low + k * step`` because the loader requires ``low`` to be a
    multiple of ``step`` under ``backend: ray``.
    """
    from ray import tune

    out: dict[str, Any] = {}
    for key, p in search.items():
        if isinstance(p, FloatParam):
            if p.log:
                out[key] = tune.loguniform(p.low, p.high)
            elif p.step is not None:
                out[key] = tune.quniform(p.low, p.high, p.step)
            else:
                out[key] = tune.uniform(p.low, p.high)
        elif isinstance(p, IntParam):
            if p.log:
                out[key] = tune.lograndint(p.low, p.high + 1)
            elif p.step not in (None, 1):
                out[key] = tune.qrandint(p.low, p.high, p.step)
            else:
                out[key] = tune.randint(p.low, p.high + 1)
        else:
            out[key] = tune.choice(list(p.choices))
    return out


def ray_grid_space(search: dict[str, Any]) -> dict[str, Any]:
    """``tune.grid_search`` over the same values as :func:`grid_search_space`."""
    from ray import tune

    return {key: tune.grid_search(values) for key, values in grid_search_space(search).items()}


def split_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split sampled params into (train-config overrides, task arguments without 'task.')."""
    train: dict[str, Any] = {}
    task: dict[str, Any] = {}
    for key, value in params.items():
        if key.startswith(TASK_PREFIX):
            task[key[len(TASK_PREFIX):]] = value
        else:
            train[key] = value
    return train, task


def signature(search: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Canonical, JSON-able form of ``search`` (sorted keys, every field) to detect a changed space."""
    return {key: search[key].model_dump(mode="json") for key in sorted(search)}
