"""The spec's ``warm_start:`` section: a new study starts from the best configurations of an
earlier one (sweeps/backends/optuna_warm_start.py enqueues them).

``warm_start: {from: lr_bs, top: 3}`` enqueues the 3 best completed trials of study ``lr_bs``
(found in this spec's storage: the default ``runs/lr_bs.journal``, or the same database) as the
new study's first trials. The search spaces may differ: the parameters both search, with a value
inside the new range or choices, are carried over; the others are drawn by the sampler.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Problem = tuple[tuple[Any, ...], str]


class WarmStartSection(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    study: str = Field(alias="from")  # the earlier study's name (its latest version)
    top: int = Field(5, ge=1)  # how many of its best completed trials to start from


def warm_start_problems(s: dict[str, Any], out: list[Problem]) -> None:
    """The rules spanning the section and the rest of the spec."""
    ws = s.get("warm_start")
    if ws is None:
        return
    if s.get("backend") == "ray":
        out.append((("warm_start",), "is supported on backend optuna only (it enqueues Optuna trials); remove it "
                                     "or use backend: optuna"))
    if ws.study == s.get("name"):
        out.append((("warm_start", "from"), f"{ws.study!r} is this study; name an earlier study, or extend this "
                                            "one with: sweeps run SPEC --add-trials N"))
    if not s.get("search"):
        out.append((("warm_start",), "needs a search section: it carries over searched parameters"))
