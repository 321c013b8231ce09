"""Task: what is specific to one problem -- the model, the data, the loss, the metrics and how
the trained model is called -- for one set of hyperparameters.

A task knows nothing about loops, devices or sweeps. ``core.train`` calls ``build_model()``,
``datasets()``, ``make_loss()`` and ``metrics()`` once per run, after seeding, so a task that
initialises weights randomly is reproducible from the run's seed. The defaults are those of
image classification (cross-entropy, accuracy, argmax), so a classification task only gives its
model and data; a task of another shape overrides the loss, the metrics and ``postprocess``.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from core.tasks.accuracy import Accuracy, EpochMetric
from core.tasks.inputs import InputSpec

if TYPE_CHECKING:  # torch is imported where a model or data is built, not to name or check a task
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from core.config import TrainConfig

Loss = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]  # (model output, target) -> scalar


class TaskError(ValueError):
    """A task name, model, argument or data path is wrong; the message says how to fix it."""


class DataError(TaskError):
    """The task's data cannot be trained on as it is (NaN or infinite values): a problem of the
    data, not of the hyperparameters. The message names the dataset, the count and the fix."""


class Task:
    """Base class of every task. Subclasses set ``name``, ``models`` and (classification)
    ``num_classes``; they give ``build_model`` and ``datasets`` and, for a problem that is not
    classification, ``make_loss``, ``metrics`` and ``postprocess``."""

    name: str = "task"
    models: tuple[str, ...] = ()
    num_classes: int = 0  # classification: the default loss, metrics and confusion matrix use it
    input_shape: tuple[int, ...] = ()  # one sample's model-input shape (e.g. C, H, W); used for ONNX export
    # One sentence for the registered model's description: what a caller passes and gets back.
    input_contract: str = ""
    # What the registered model answers (core/tasks/inputs.py): the dtype kinds, each sample's shape
    # and the range of the natural input ``preprocess`` takes; it refuses a batch with any row outside
    # it, or holding NaN or infinity. Default: any finite floats or integers, of any shape.
    natural_input: InputSpec = InputSpec()
    # The reported names of ``metrics()`` and their directions ({"val_rmse": "minimize"}), readable
    # without importing torch, so `sweeps validate` can check a study's objective. Optional for a
    # task that overrides ``metrics()`` (then checked when a run starts); train() refuses a mismatch.
    metric_directions: dict[str, str] | None = None
    # Turns a list of samples into one (input_tensor, target_tensor) batch, in both loaders and
    # the end-of-run evaluation; None stacks them (torch's default_collate). Set it when samples
    # do not stack as they are, e.g. sequences of different lengths to pad. Define it as a method
    # or assign it in __init__ (a plain function set on the class would be bound to the task).
    collate_fn: Callable[[list[Any]], Any] | None = None
    # Submodules (names from ``model.named_modules()``) whose activations backward recomputes instead
    # of keeping (gradient checkpointing, core/grad_checkpoint.py): less memory for one more forward
    # of them. Applied by core.train when it builds the model; built-in tasks that offer it take
    # ``task.args.checkpoint_blocks``. Empty: off.
    checkpoint_blocks: tuple[str, ...] = ()

    def build_model(self) -> nn.Module:
        """Return a fresh, randomly initialised (or locally pretrained) model. Called once per run."""
        raise NotImplementedError

    def datasets(self) -> tuple[Dataset, Dataset]:
        """Return ``(train, val)`` datasets yielding ``(model_input, target)`` pairs (for
        classification the target is the class index). Called once per run.

        Map-style datasets (``__getitem__`` and ``__len__``) are shuffled by the run's seed.
        A ``torch.utils.data.IterableDataset`` (a stream) is read in its own order and needs
        ``train.max_steps_per_epoch`` (batches per epoch) unless it has a ``__len__``; an epoch
        also ends when the stream does, and each epoch iterates it afresh. A stream shards itself:
        over loader workers (``get_worker_info()``) and, under DDP, over ranks
        (``torch.distributed.get_rank()``), every rank yielding at least ``max_steps_per_epoch``
        batches. Random augmentation may use torch, numpy or ``random``: it is seeded per batch.
        """
        raise NotImplementedError

    def make_loss(self, cfg: TrainConfig) -> Loss:
        """The training loss: ``loss(model_output, target)`` returns a scalar tensor, averaged over
        the batch. Called once per run; also reported as ``train_loss`` and ``val_loss``.
        Default: cross-entropy with ``cfg.label_smoothing``."""
        from torch import nn

        return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    def metrics(self) -> Mapping[str, EpochMetric]:
        """Fresh metrics (torchmetrics ones, or any :class:`EpochMetric`), each reported as
        ``val_<name>`` after every epoch and usable as the study's ``objective.metric``; each
        metric's ``higher_is_better`` is its direction. They are updated on every validation batch
        with ``(postprocess(output), target)``, so they judge the predictions users get. Called once
        per run. Default: accuracy (``val_acc``). A task that overrides it also sets
        ``metric_directions`` so the spec can be checked early."""
        return {"acc": Accuracy()}

    def preprocess(self, natural: torch.Tensor) -> torch.Tensor:
        """From natural input (what a user of the registered model has, e.g. raw pixel values) to
        a model-input batch. Called by the registered model before the forward pass; ``datasets()``
        yields what it returns. Default: unchanged (as float32)."""
        return natural.float()

    def postprocess(self, output: torch.Tensor) -> torch.Tensor:
        """From a model-output batch to predictions in the target's terms (a class index, a value
        in the target's units, a mask). Called by the metrics and by the registered model after
        the forward pass. Default: the argmax class index."""
        return output.argmax(dim=1)

    def natural_examples(self, n: int) -> torch.Tensor | None:
        """Up to ``n`` validation inputs in natural units (what ``preprocess`` takes), for the
        registered model's input example and signature; None when the task has none to give (the
        registered model then takes model inputs). Called by ``sweeps promote``."""
        return None

    def backbone(self, model: nn.Module) -> nn.Module | None:
        """The pretrained part of ``model`` (own learning rate, optional freeze phase), or None."""
        return None

    def describe(self) -> dict[str, Any]:
        """Task parameters worth logging with the run."""
        return {"task": self.name}

    def describe_dataset(self, dataset: Any, split: str) -> dict[str, Any]:
        """What the run records about the ``split`` ("train" or "val") dataset ``datasets()``
        returned: ``name``, ``source`` (where it comes from), ``digest`` (None when it cannot be
        told cheaply) and ``profile`` (its size and one sample's shape). Called once per run on the
        datasets already built: a digest must not load the data a second time. The default hashes
        in-memory tensors/arrays (``x``/``y`` or ``data``/``targets``, as the built-in tasks and
        torchvision keep them) or an image folder's file list; a task whose data is elsewhere
        overrides it."""
        import hashlib

        import numpy as np

        digest = hashlib.sha256()
        profile: dict[str, Any] = {"num_rows": len(dataset) if hasattr(dataset, "__len__") else None}
        source, hashed = f"task:{self.name}", False
        arrays = [getattr(dataset, a, None) for a in ("x", "y")] if hasattr(dataset, "x") else \
            [getattr(dataset, a, None) for a in ("data", "targets")]
        for array in arrays:
            if array is None:
                continue
            data = np.ascontiguousarray(array.numpy() if hasattr(array, "numpy") else np.asarray(array))
            # Past 64 MB, every k-th row: a digest that changes with the data, at a bounded cost.
            stride = max(1, data.nbytes // (64 << 20)) if data.ndim else 1
            digest.update(repr((data.shape, str(data.dtype), stride)).encode())
            digest.update(np.ascontiguousarray(data[::stride] if data.ndim else data).tobytes())
            profile.setdefault("shape", list(data.shape[1:]))
            hashed = True
        samples = getattr(dataset, "samples", None)  # torchvision ImageFolder / DatasetFolder
        if not hashed and isinstance(samples, list):
            digest.update(repr(samples).encode())
            source, hashed = str(getattr(dataset, "root", source)), True
        root = getattr(dataset, "root", None)
        if isinstance(root, str) and hashed:
            source = root
        return {"name": f"{self.name}-{split}", "source": source, "profile": profile,
                "digest": digest.hexdigest()[:32] if hashed else None}


def block_names(task_name: str, value: Any) -> tuple[str, ...]:
    """``task.args.checkpoint_blocks`` checked: a list of submodule names (strings), else TaskError."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TaskError(f"task {task_name!r}: checkpoint_blocks is {value!r}; give a list of submodule names, "
                        f"e.g. [layer1, layer2]")
    return tuple(value)


TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}
ENTRY_POINT_GROUP = "sweeps.tasks"
# Declared tasks by id, holding the object so its id cannot be reused by another one. An
# identity table, not an attribute: getattr on an arbitrary object (a proxy whose __getattr__
# answers every name) could fake a mark, and a subclass would inherit one.
_DECLARED: dict[int, tuple[Any, str | None]] = {}
_DECLARE_HOW = ("declare it in its module with `from core.tasks import task` and `@task` on the factory "
                f"(or Task subclass), or install it as a {ENTRY_POINT_GROUP!r} entry point and use task.name")


def _declare(obj: Any, name: str | None) -> Any:
    if isinstance(obj, type) and not issubclass(obj, Task):
        raise TypeError(f"@task on class {obj.__qualname__}: only core.tasks.Task subclasses are tasks")
    if not callable(obj):
        raise TypeError(f"@task on {obj!r}: a task is a factory function or a core.tasks.Task subclass")
    _DECLARED[id(obj)] = (obj, name)
    return obj


def task(arg: Any = None) -> Any:
    """Declare a task: a factory returning a :class:`Task`, or a Task subclass. Only declared
    callables may be named by a spec's ``task.target`` (a spec picks among tasks, it never
    calls arbitrary code). ``@task``, or ``@task("name")`` to call it ``name`` in messages."""
    if arg is None or isinstance(arg, str):
        return lambda obj: _declare(obj, arg)
    return _declare(arg, None)


def is_declared(obj: Any) -> bool:
    """Whether ``obj`` itself (not an equal or a subclass) was declared with :func:`task` or :func:`register`."""
    entry = _DECLARED.get(id(obj))
    return entry is not None and entry[0] is obj


def declared_name(obj: Any) -> str | None:
    """The name given with ``@task("name")`` (or :func:`register`), else None."""
    return _DECLARED[id(obj)][1] if is_declared(obj) else None


def register(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """A built-in task under ``name`` (``task.name``); it is declared as well."""
    def deco(factory: TaskFactory) -> TaskFactory:
        _REGISTRY[name] = _declare(factory, name)
        return factory

    return deco


# Each built-in task's module, which registers it with :func:`register` when imported. The names
# are known without importing anything, and a lookup imports only the task asked for: the task
# modules import this one, and a digits trial never loads torchvision for the image tasks.
BUILTIN_TASK_MODULES = {name: f"core.tasks.{name}"
                        for name in ("cifar10", "diabetes", "digits", "imagefolder", "shapes", "synthetic")}


def builtin_task_names() -> list[str]:
    return sorted(BUILTIN_TASK_MODULES)


def entry_point_task_names() -> list[str]:
    """Names of the installed ``sweeps.tasks`` entry points (read from metadata, nothing imported)."""
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def task_names() -> list[str]:
    """Every name ``task.name`` accepts: the built-in tasks and the installed entry points."""
    return sorted(set(builtin_task_names()) | set(entry_point_task_names()))


def _builtin(name: str) -> TaskFactory:
    if name not in _REGISTRY:
        importlib.import_module(BUILTIN_TASK_MODULES[name])
    return _REGISTRY[name]


def _from_entry_point(name: str) -> TaskFactory:
    found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).select(name=name))
    if not found:
        raise TaskError(
            f"task.name: unknown task {name!r}; tasks are {', '.join(task_names())}, "
            "or use task.target: 'mypkg.module:make_task' naming a factory declared with @task"
        )
    if len({ep.value for ep in found}) > 1:
        raise TaskError(f"task.name: {name!r} is declared by several {ENTRY_POINT_GROUP!r} entry points "
                        f"({', '.join(sorted({ep.value for ep in found}))}); uninstall all but one")
    try:
        factory = found[0].load()
    except Exception as exc:  # the entry point's module failing at import, or a wrong attribute
        raise TaskError(f"task.name: entry point {name!r} ({found[0].value}) could not be loaded: "
                        f"{type(exc).__name__}: {exc}") from exc
    if not callable(factory):
        raise TaskError(f"task.name: entry point {name!r} ({found[0].value}) is not a callable")
    return factory


def resolve_factory(name: str | None = None, target: str | None = None) -> TaskFactory:
    """Find a declared task factory: a built-in or ``sweeps.tasks`` entry point by ``name``, or
    a ``module:callable`` ``target`` declared with :func:`task`. Every path that builds a task
    from a spec comes through here, so nothing undeclared is ever called, nor its signature read."""
    if (name is None) == (target is None):
        raise TaskError("task: give exactly one of 'name' (a built-in task) or 'target' (module:callable)")
    if name is not None:
        return _builtin(name) if name in BUILTIN_TASK_MODULES else _from_entry_point(name)
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
    if not is_declared(factory):
        raise TaskError(f"task.target: {target!r} is not a declared task, and a spec may only name declared "
                        f"tasks; {_DECLARE_HOW}")
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
    label = name or declared_name(factory) or target
    kwargs = dict(args or {})
    if model is not None:
        kwargs["model"] = model
    accepted = factory_arg_names(factory)
    if accepted is not None:
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise TaskError(
                f"task.args: {', '.join(unknown)} not accepted by task {label!r}; "
                f"it accepts {', '.join(a for a in accepted if a != 'model') or 'no arguments'}"
            )
    built = factory(**kwargs)
    if not isinstance(built, Task):
        raise TaskError(f"task {label!r} returned {type(built).__name__}, not a core.tasks.Task")
    return built


def check_model_name(task_name: str, model: str, models: tuple[str, ...]) -> None:
    if model not in models:
        raise TaskError(f"task.model: {model!r} is not offered by task {task_name!r}; "
                        f"choose one of {', '.join(models)}")
