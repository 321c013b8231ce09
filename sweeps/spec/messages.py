"""Spec problems as messages: pydantic's errors rewritten in the spec's own words, and rendering.

A problem is ``(field path, text)``; :func:`render` turns it into
``search.lr.low: 0.0 with log: true; a log scale needs low > 0 ... (line 14)``.
pydantic's own text is never shown: it names internal types and union tags, not the
spec's keys, and says nothing about the fix.
"""
from __future__ import annotations

import difflib
import re
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from sweeps.spec import search_space as ss
from sweeps.spec.model import StudySpec
from sweeps.spec.search_space import CategoricalParam, FloatParam, IntParam, Problem

BOOL_WORDS = ("yes", "no", "on", "off", "y", "n")  # booleans in YAML 1.1, strings in a study spec
_PARAM_MODELS = {"float": FloatParam, "int": IntParam, "categorical": CategoricalParam}
_MISSING_HINTS = {
    ("name",): "required; a study name such as lr_bs (letters, digits, _ . -)",
    ("task",): "required; give task.name (a built-in task such as digits) or task.target (module:callable)",
}


# ----------------------------------------------------------------------------- rendering
def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def render(loc: tuple[Any, ...], text: str, lines: dict[tuple[str, ...], int]) -> str:
    """``search.lr.low: <text> (line 14)``: the line of the deepest key the file has."""
    keys = tuple(str(p) for p in loc)
    line = next((lines[keys[:n]] for n in range(len(keys), 0, -1) if keys[:n] in lines), None)
    head = f"{_dotted(loc)}: " if loc else ""
    return f"{head}{text}" + (f" (line {line})" if line else "")


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(word: Any, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def foreign(message: str, default_loc: tuple[Any, ...]) -> Problem:
    """A message from core ("train.lr: ...", "task.model: ...") as a problem at its own path."""
    match = re.match(r"^((?:train|task)(?:\.[A-Za-z0-9_]+)*): (.*)$", message, re.S)
    if match:
        return tuple(match.group(1).split(".")), match.group(2)
    return default_loc, message


# ------------------------------------------------------------------- pydantic's errors
def unwrap(ann: Any) -> Any:
    while True:
        if get_origin(ann) is Annotated:
            ann = get_args(ann)[0]
            continue
        args = [a for a in get_args(ann) if a is not type(None)]
        if get_origin(ann) in (Union, types.UnionType) and len(args) == 1:
            ann = args[0]
            continue
        return ann


def _walk(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], type[BaseModel] | None]:
    """Drop pydantic's union tags from ``loc``; also return the model holding the last key."""
    ann: Any = StudySpec
    clean: list[Any] = []
    parent: type[BaseModel] | None = None
    for item in loc:
        ann = unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            parent = ann
            clean.append(item)
            field = ann.model_fields.get(item) if isinstance(item, str) else None
            ann = field.annotation if field else None
        elif get_origin(ann) in (Union, types.UnionType) and item in _PARAM_MODELS:
            ann = _PARAM_MODELS[item]  # the discriminator tag pydantic adds: not a spec key
        elif get_origin(ann) is dict:
            clean.append(item)
            ann = get_args(ann)[1]
        elif get_origin(ann) is list:
            clean.append(item)
            ann = get_args(ann)[0]
        else:
            clean.append(item)
            ann = None
    return tuple(clean), parent


def _type_text(kind: str, value: Any) -> str:
    hint = ""
    if isinstance(value, str) and value.lower() in BOOL_WORDS and kind == "true or false":
        hint = " (only true and false are booleans in a study spec)"
    elif isinstance(value, str) and kind in ("an integer", "a number"):
        hint = " (write the number without quotes)"
    elif kind == "a string" and isinstance(value, (int, float, bool)):
        hint = " (quote it to make it a string)"
    return f"expected {kind}, got {show(value)}{hint}"


def _error_text(err: ErrorDetails, loc: tuple[Any, ...], parent: type[BaseModel] | None) -> tuple[tuple, str]:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if loc and loc[-1] == "[key]":  # pydantic's marker for a bad mapping key: ('search', 1, '[key]')
        return loc[:-2], f"the key {show(value)} is not a string; put it in quotes"
    if kind == "extra_forbidden":
        # A field's YAML key is its alias where it has one (warm_start's `from`, a Python keyword).
        allowed = [f.alias or name for name, f in parent.model_fields.items()] if parent else []
        what = "unknown section" if parent is StudySpec else "unknown key"
        return loc, f"{what}{did_you_mean(loc[-1], allowed)}; allowed here: {', '.join(allowed)}"
    if kind == "missing":
        tag = next((t for t, m in _PARAM_MODELS.items() if m is parent), None)
        return loc, _MISSING_HINTS.get(loc, f"required for type {tag}" if tag else "required")
    if kind == "union_tag_invalid":
        return loc + ("type",), (f"{ctx.get('tag')!r} is not a parameter type"
                                 f"{did_you_mean(ctx.get('tag'), list(ss.PARAM_TYPES))}; use float, int or categorical")
    if kind == "union_tag_not_found":
        return loc + ("type",), "required; use float, int or categorical"
    if kind in ("model_attributes_type", "dict_type", "model_type"):
        example = " like {type: float, low: 1.0e-4, high: 0.1}" if loc[:1] == ("search",) and len(loc) == 2 else ""
        return loc, f"expected a mapping{example}, got {show(value)}"
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", ctx.get("expected", ""))
        return loc, (f"{show(value)} is not allowed{did_you_mean(value, options)}; "
                     f"use one of {', '.join(options) or ctx.get('expected')}")
    kinds = {"bool_type": "true or false", "bool_parsing": "true or false", "int_type": "an integer",
             "int_from_float": "an integer", "int_parsing": "an integer", "float_type": "a number",
             "float_parsing": "a number", "string_type": "a string", "list_type": "a list",
             "finite_number": "a finite number"}
    if kind in kinds:
        return loc, _type_text(kinds[kind], value)
    bounds = {"greater_than": "> {gt}", "greater_than_equal": ">= {ge}", "less_than": "< {lt}",
              "less_than_equal": "<= {le}"}
    if kind in bounds:
        return loc, f"{show(value)} is out of range; use a value {bounds[kind].format(**ctx)}"
    if kind == "invalid_key":
        return loc[:-1], f"the key {show(value)} is not a string; put it in quotes"
    if kind in ("value_error", "assertion_error"):
        return loc, str(ctx.get("error", err["msg"]))
    return loc, f"{show(value)}: {err['msg']}"


def pydantic_problems(exc: ValidationError) -> list[Problem]:
    """pydantic's errors as spec problems; a 'missing' key explained by a misspelt one is dropped."""
    items = [(err, *_walk(tuple(err["loc"]))) for err in exc.errors(include_url=False)]
    explained: set[tuple[Any, ...]] = set()
    for err, loc, parent in items:
        if err["type"] == "extra_forbidden" and parent is not None:
            close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1, cutoff=0.6)
            explained.update(loc[:-1] + (c,) for c in close)
    return [_error_text(err, loc, parent) for err, loc, parent in items
            if not (err["type"] == "missing" and loc in explained)]
