"""Task: the model and the data for one set of hyperparameters.

A task knows nothing about loops, devices or sweeps. ``core.train`` calls
``build_model()`` and ``datasets()`` once per run, after seeding, so a task that
initialises weights randomly is reproducible from the run's seed.
"""
from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch is imported where a model or data is built, not to name or check a task
    from torch import nn
    from torch.utils.data import Dataset


class TaskError(ValueError):
    """A task name, model, argument or data path is wrong; the message says how to fix it."""


class Task:
    """Base class of every task. Subclasses set ``name``, ``models`` and ``num_classes``."""

    name: str = "task"
    models: tuple[str, ...] = ()
    num_classes: int = 0
    input_shape: tuple[int, ...] = ()  # one sample's shape (C, H, W); used for ONNX export

    def build_model(self) -> nn.Module:
        """Return a fresh, randomly initialised (or locally pretrained) model. Called once per run."""
        raise NotImplementedError

    def datasets(self) -> tuple[Dataset, Dataset]:
        """Return ``(train, val)`` datasets yielding ``(input_tensor, int_label)``. Called once per run."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Called at most once per worker process, before its first run, while the worker waits
        for its go, on a task built from the spec's fixed arguments (skipped if that fails):
        import what ``datasets`` and ``build_model`` need (seconds in a fresh process) without
        reading any data. Default: nothing."""

    def backbone(self, model: nn.Module) -> nn.Module | None:
        """The pretrained part of ``model`` (own learning rate, optional freeze phase), or None."""
        return None

    def describe(self) -> dict[str, Any]:
        """Task parameters worth logging with the run."""
        return {"task": self.name}


TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}


def register(name: str) -> Callable[[TaskFactory], TaskFactory]:
    def deco(factory: TaskFactory) -> TaskFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def builtin_task_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    # Imported lazily so `import core` stays cheap and torchvision is loaded only when needed.
    from core.tasks import cifar10, digits, imagefolder, synthetic  # noqa: F401


def resolve_factory(name: str | None = None, target: str | None = None) -> TaskFactory:
    """Find a task factory by built-in name or by a ``module:callable`` import path."""
    if (name is None) == (target is None):
        raise TaskError("task: give exactly one of 'name' (a built-in task) or 'target' (module:callable)")
    if name is not None:
        _load_builtins()
        if name not in _REGISTRY:
            raise TaskError(
                f"task.name: unknown task {name!r}; built-in tasks are {', '.join(sorted(_REGISTRY))}, "
                "or use task.target: 'mypkg.module:make_task'"
            )
        return _REGISTRY[name]
    assert target is not None
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise TaskError(f"task.target: {target!r} must look like 'package.module:callable'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"task.target: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"task.target: {module_name!r} has no callable named {attr!r}")
    return factory


def factory_arg_names(factory: TaskFactory) -> list[str] | None:
    """Keyword arguments a factory accepts (None when it takes **kwargs)."""
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def make_task(name: str | None = None, *, target: str | None = None, model: str | None = None,
              args: dict[str, Any] | None = None) -> Task:
    """Build a task from a spec's ``task:`` section."""
    factory = resolve_factory(name, target)
    kwargs = dict(args or {})
    if model is not None:
        kwargs["model"] = model
    accepted = factory_arg_names(factory)
    if accepted is not None:
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise TaskError(
                f"task.args: {', '.join(unknown)} not accepted by task {name or target!r}; "
                f"it accepts {', '.join(a for a in accepted if a != 'model') or 'no arguments'}"
            )
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise TaskError(f"task {name or target!r} returned {type(task).__name__}, not a core.tasks.Task")
    return task


def check_model_name(task_name: str, model: str, models: tuple[str, ...]) -> None:
    if model not in models:
        raise TaskError(f"task.model: {model!r} is not offered by task {task_name!r}; choose one of {', '.join(models)}")
