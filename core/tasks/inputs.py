"""What a task's registered model answers: the contract of its natural input (``Task.natural_input``).

A model answers any array it is given: NaN pixels, images scaled by 16, negative counts all come
back as confident predictions. The registered model (``sweeps.serving``) checks every batch
against the task's :class:`InputSpec` before ``preprocess`` and refuses the whole batch, in one
line, when any row falls outside it: an answer made up for one row of a batch is not returned
beside the others' real ones.

The spec says what numbers mean something to the task: the dtype kinds it reads (floats and
integers alike by default), each sample's shape, and the range of values it was trained on.
Values must always be finite.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_KIND_NAMES = {"f": "float", "i": "integer", "u": "unsigned integer", "b": "boolean"}
ROWS_NAMED = 5  # offending rows named in a refusal; the rest are counted


class InputRefused(ValueError):
    """A batch the registered model will not answer; the message is one line saying why and what it takes."""


@dataclass(frozen=True)
class InputSpec:
    """The natural input a task's registered model takes (what ``Task.preprocess`` is given).

    ``kinds``: numpy dtype kinds accepted, "f" float, "i" integer, "u" unsigned integer, "b" boolean;
    every one of them is converted by ``preprocess``, so float64, float32, int64 and uint8 arrays of
    the same values get the same answer. ``shapes``: the accepted shapes of one sample, -1 for an axis
    of any size; empty: not checked here (``preprocess`` checks what it needs). ``low``/``high``: the
    closed range of values the task was trained on, None where it declares no bound. NaN and infinity
    are always refused."""

    kinds: str = "fiu"
    shapes: tuple[tuple[int, ...], ...] = ()
    low: float | None = None
    high: float | None = None

    def describe(self) -> str:
        """The spec in a few words, for a refusal: "finite float or integer values 0 to 16, each
        sample shaped (8, 8) or (64,)"."""
        kinds = " or ".join(dict.fromkeys(_KIND_NAMES[k].split()[-1] for k in self.kinds if k in _KIND_NAMES))
        bounds = ("" if self.low is None and self.high is None else f" {self.bounds()}")
        shapes = f", each sample shaped {' or '.join(_shape_text(s) for s in self.shapes)}" if self.shapes else ""
        return f"finite {kinds} values{bounds}{shapes}"

    def bounds(self) -> str:
        """The declared range: "0 to 16", ">= 0", "<= 1"."""
        if self.low is not None and self.high is not None:
            return f"{self.low:g} to {self.high:g}"
        return f">= {self.low:g}" if self.low is not None else f"<= {self.high:g}"

    def check(self, rows: np.ndarray) -> None:
        """Raise :class:`InputRefused` unless every row of the batch ``rows`` (an array, or a
        one-dimensional object array of samples of different shapes) meets the spec."""
        import numpy as np  # numpy only where a batch is checked: naming a task stays free of it

        samples = [np.asarray(r) for r in rows] if rows.dtype == object else [rows]
        n = len(rows)
        for arr in samples:
            if arr.dtype.kind not in self.kinds:
                raise InputRefused(f"input of dtype {arr.dtype} refused: the model takes {self.describe()}")
            shape = arr.shape if rows.dtype == object else arr.shape[1:]
            if self.shapes and not any(_fits(shape, s) for s in self.shapes):
                raise InputRefused(f"input sample shaped {_shape_text(shape)} refused (a batch of {n}): the model "
                                   f"takes {self.describe()}")

        def rows_where(test) -> np.ndarray:  # the rows where ``test`` holds for any value
            if rows.dtype == object:
                return np.array([i for i, arr in enumerate(samples) if test(arr).any()], dtype=np.int64)
            return np.flatnonzero(test(rows).reshape(n, -1).any(1))

        # Only floats hold NaN or infinity, and only declared bounds need a pass over the values.
        if any(a.dtype.kind == "f" for a in samples):
            nonfinite = rows_where(lambda a: ~np.isfinite(a) if a.dtype.kind == "f" else np.zeros(a.shape, bool))
            if len(nonfinite):
                raise InputRefused(f"input refused: {_rows_text(nonfinite, n)} NaN or infinity, which the model "
                                   f"cannot answer; it takes {self.describe()}")
        if self.low is None and self.high is None:
            return
        low = -np.inf if self.low is None else self.low
        high = np.inf if self.high is None else self.high
        outside = rows_where(lambda a: (a < low) | (a > high))
        if len(outside):
            found = [a for a in samples if a.size]
            lowest, highest = min(a.min() for a in found), max(a.max() for a in found)
            raise InputRefused(f"input refused: {_rows_text(outside, n)} values outside {self.bounds()} "
                               f"(min {lowest:g}, max {highest:g}); the model takes {self.describe()}")


def _fits(shape: tuple[int, ...], spec: tuple[int, ...]) -> bool:
    return len(shape) == len(spec) and all(s == -1 or s == d for d, s in zip(shape, spec, strict=True))


def _shape_text(shape: tuple[int, ...]) -> str:
    inner = ", ".join("any" if d == -1 else str(d) for d in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def _rows_text(rows: np.ndarray, n: int) -> str:
    """The offending rows of a batch of ``n`` and their verb: "row 3 of 64 holds", "rows 3, 7 of 64 hold"."""
    named = ", ".join(str(int(r)) for r in rows[:ROWS_NAMED])
    more = f" and {len(rows) - ROWS_NAMED} more" if len(rows) > ROWS_NAMED else ""
    return f"rows {named}{more} of {n} hold" if len(rows) > 1 else f"row {named} of {n} holds"
