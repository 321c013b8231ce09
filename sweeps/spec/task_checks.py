"""The rules of a spec's ``task:`` section (part of :mod:`sweeps.spec.checks`).

The task is resolved through :func:`core.tasks.base.resolve_factory`, which refuses a
``task.target`` that was not declared with ``@task`` before anything of it is called or
even inspected; then its arguments and models are checked against the factory's signature
and return annotation. Only built-in tasks are built here (cheap, no data by contract).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, get_type_hints

from core.tasks.base import (
    Task,
    TaskError,
    builtin_task_names,
    declared_name,
    factory_arg_names,
    make_task,
    resolve_factory,
    task_names,
)
from sweeps.spec import search_space as ss
from sweeps.spec.messages import did_you_mean, foreign, show
from sweeps.spec.search_space import CategoricalParam, Problem


class TaskInfo:
    def __init__(self, label: str, accepted: list[str] | None, hints: dict[str, Any], models: tuple[str, ...],
                 builtin: bool) -> None:
        self.label, self.accepted, self.hints, self.models, self.builtin = label, accepted, hints, models, builtin
        self.built: Any = None  # the task built with the fixed args (built-in tasks, by instantiate_checks)


@contextlib.contextmanager
def _no_bytecode() -> Iterator[None]:
    # Importing a task.target must not write __pycache__ next to the user's module: loading creates no files.
    old, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        yield
    finally:
        sys.dont_write_bytecode = old


def _declared_models(factory: Any) -> tuple[str, ...]:
    """``models`` of the Task class a factory is or declares it returns, without calling it."""
    cls = factory
    if not isinstance(factory, type):
        try:
            cls = get_type_hints(factory).get("return")
        except Exception:  # noqa: BLE001 - unresolvable annotations in a user's module: no cheap check possible
            return ()
    return tuple(cls.models) if isinstance(cls, type) and issubclass(cls, Task) else ()


def task_problems(s: dict[str, Any], out: list[Problem]) -> TaskInfo | None:
    task = s["task"]
    if task is None:
        return None
    if (task.name is None) == (task.target is None):
        out.append((("task",), f"give exactly one of name (a task: {', '.join(task_names())}) "
                               "or target (module:callable declared with @task)"))
        return None
    which = "name" if task.name is not None else "target"
    try:
        with _no_bytecode():
            factory = resolve_factory(task.name, task.target)  # refuses an undeclared target before any call
    except TaskError as exc:
        hint = did_you_mean(task.name, task_names()) if task.name else ""
        loc, text = foreign(str(exc), ("task", which))
        out.append((loc, text + hint))
        return None
    except Exception as exc:  # noqa: BLE001 - a user's module failing at import time: report, don't crash the loader
        out.append((("task", which), f"{getattr(task, which)!r} could not be loaded: {type(exc).__name__}: {exc}"))
        return None
    accepted = factory_arg_names(factory)
    try:
        hints = get_type_hints(factory)
    except Exception:  # noqa: BLE001 - unresolvable annotations in a user's module: no hints
        hints = {}
    # Only built-in tasks are built while validating (instantiate_checks); an entry point's is a user's task.
    builtin = task.name is not None and task.name in builtin_task_names()
    info = TaskInfo(task.name or declared_name(factory) or task.target, accepted, hints, _declared_models(factory),
                    builtin)
    takes = ", ".join(a for a in accepted or [] if a != "model") or "no arguments"
    for arg in task.args:
        if arg == "model":
            out.append((("task", "args", "model"), "set the model with task.model, not in task.args"))
        elif accepted is not None and arg not in accepted:
            out.append((("task", "args", arg), f"task {info.label!r} has no argument {arg!r}"
                                               f"{did_you_mean(arg, accepted)}; it takes {takes}"))
    # Built-in tasks check their model when built (instantiate_checks): imagefolder takes any
    # torchvision model, more than its `models` lists. A user's task is not built, so read `models`.
    if not info.builtin and task.model is not None and info.models and task.model not in info.models:
        out.append((("task", "model"), f"{task.model!r} is not offered by task {info.label!r}"
                                       f"{did_you_mean(task.model, list(info.models))}; "
                                       f"use one of {', '.join(info.models)}"))
    return info


def representatives(p: Any) -> list[tuple[str, Any]]:
    """The values a search parameter's draws are checked with: its bounds, or each choice."""
    if isinstance(p, CategoricalParam):
        return [("choices", c) for c in p.choices]
    return [("low", p.low), ("high", p.high)]


def instantiate_checks(s: dict[str, Any], info: TaskInfo, out: list[Problem]) -> None:
    """Build built-in tasks with the fixed args and each searched bound/choice: their constructors
    are cheap and touch no data by contract, and they know their own argument ranges."""
    task = s["task"]
    # Arguments already reported as unknown are left out, so the rest (model, values) still gets checked.
    fixed = {k: v for k, v in task.args.items() if k != "model" and (info.accepted is None or k in info.accepted)}
    attempts: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = [((), fixed, None)]
    for key, p in (s["search"] or {}).items():
        arg = key[len(ss.TASK_PREFIX):]
        if key.startswith(ss.TASK_PREFIX) and (info.accepted is None or arg in info.accepted):
            attempts += [(("search", key, which), {**fixed, arg: v}, v) for which, v in representatives(p)]
    for loc, args, value in attempts:
        model = args.pop("model", task.model)
        try:
            built = make_task(task.name, model=model, args=args)
            if not loc:
                info.built = built
        except Exception as exc:  # noqa: BLE001 - TaskError, or ValueError/TypeError from a task's own checks
            if not loc:
                out.append(foreign(str(exc), ("task",)))
                with contextlib.suppress(Exception):  # its metrics, to check the objective's all the same
                    info.built = make_task(task.name)
                return  # every searched value would fail the same way
            out.append((loc, f"{show(value)} is refused by task {info.label!r}: {exc}"))
