"""Several objectives at once: which trials are on the Pareto front, and the conditions a user
writes to pick among them (``sweeps promote SPEC --where "onnx_latency_ms<=2"``).

A trial dominates another when it is at least as good in every objective and better in one;
the front is the trials no other trial dominates (Optuna's ``study.best_trials`` for a study it
ran; this module serves every backend and the stored values alike).
"""
from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from sweeps.errors import UsageError

Direction = str  # "maximize" | "minimize"


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[Direction]) -> bool:
    """Whether values ``a`` dominate ``b`` under ``directions`` (one per objective)."""
    better = False
    for x, y, direction in zip(a, b, directions, strict=True):
        if direction == "minimize":
            x, y = -x, -y
        if x < y:
            return False
        better = better or x > y
    return better


def pareto_front(points: Sequence[Sequence[float]], directions: Sequence[Direction]) -> list[int]:
    """Indices of the points no other point dominates, in their order; points with a NaN in
    any objective are never on the front (a diverged trial has no place to trade from)."""
    valid = [i for i, p in enumerate(points) if not any(math.isnan(v) for v in p)]
    return [i for i in valid if not any(dominates(points[j], points[i], directions) for j in valid if j != i)]


_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt, ">": operator.gt}
_CONDITION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_./-]*)\s*(<=|>=|==|<|>)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Condition:
    """``metric op value``, e.g. ``onnx_latency_ms <= 2``. ``==`` holds within half a unit of the
    number's last written decimal (``tolerance``): a value as a table shows it (``0.9528``) picks
    the trial it was rounded from."""

    metric: str
    op: str
    value: float
    tolerance: float = 0.0

    def holds(self, values: Mapping[str, float]) -> bool:
        """True when the trial's ``values`` meet it; a trial without the metric does not."""
        got = values.get(self.metric)
        if got is None or math.isnan(got):
            return False
        if self.op == "==":
            return abs(got - self.value) <= self.tolerance
        return _OPS[self.op](got, self.value)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def _half_last_digit(number: str) -> float:
    """Half a unit of the last decimal written (``0.9528`` -> 5e-05); 0 for an exponent form."""
    if "e" in number.lower():
        return 0.0
    exponent = Decimal(number).as_tuple().exponent
    return 0.5 * 10.0 ** int(exponent) if isinstance(exponent, int) else 0.0


def parse_where(text: str) -> list[Condition]:
    """Conditions joined by ``,`` or ``and``: ``"onnx_latency_ms<=2, params<1e6"``. UsageError
    (exit 2) naming the part that is not ``metric op number`` and the form expected."""
    parts = re.split(r",|\band\b", text)
    if not text.strip():
        raise UsageError(f"--where {text!r}: no condition; write e.g. --where \"onnx_latency_ms<=2\"")
    out = []
    for part in parts:
        if not part.strip():
            raise UsageError(f"--where {text!r}: an empty condition between two separators (`,` or `and`); "
                             "write e.g. --where \"onnx_latency_ms<=2, params<1e6\"")
        match = _CONDITION.match(part)
        if match is None:
            raise UsageError(f"--where {text!r}: {part.strip()!r} is not `metric op number` (op one of "
                             "<=, <, >=, >, ==); e.g. --where \"onnx_latency_ms<=2, params<1e6\"")
        metric, op, number = match.groups()
        try:
            value = float(number)
        except ValueError:
            raise UsageError(f"--where {text!r}: {number!r} in {part.strip()!r} is not a number") from None
        out.append(Condition(metric, op, value, _half_last_digit(number) if op == "==" else 0.0))
    return out
