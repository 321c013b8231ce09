"""Sanity checks before a sweep (``sweeps check SPEC``): the bugs that waste a whole sweep.

Each check builds what it needs from the task, as ``core.train`` would, and returns
:class:`Finding` lines; none raises for a problem it is looking for. The checks:

* data: the first samples of both splits batch, their input shapes agree (with each other and
  the task's ``input_shape``), class labels lie in ``[0, num_classes)``, and the validation data
  is the same each time it is read (random augmentation leaking into validation makes
  every epoch's validation a different test); no value is NaN or infinite (every value of an
  in-memory dataset, as ``core.train`` checks, else the first batch of each split);
* model: one forward and backward on a train batch give finite outputs, loss and gradients,
  every trainable parameter gets a gradient, the output depends on the input (a model that
  ignores its input can still lower the loss, towards the label frequencies);
* torchscript (with ``train.export_torchscript``): the untrained model compiles and matches eager;
* overfit: a fresh model, with Adam at 1e-3 (the usual recipe, independent of the searched
  learning rate) and no label smoothing, must lower the loss on one small fixed batch by ``factor``
  within ``steps`` (within ``OVERFIT_SECONDS``; a check that runs out of time first says it is
  inconclusive).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from core.config import TrainConfig
from core.data import nonfinite_problem
from core.forensics import nonfinite_count, tensor_stats
from core.grad_checkpoint import checkpoint_blocks
from core.in_memory import stored_tensors
from core.metrics import classes_lacking
from core.seeding import seed_everything
from core.tasks.base import Task, TaskError
from core.torchscript_export import TorchScriptError, export_torchscript

OVERFIT_LR = 1e-3
OVERFIT_SAMPLES = 8  # the fixed batch the overfit check trains on: small, so it fits in seconds
OVERFIT_STEPS = 500  # the tiny U-Net of studies/shapes_seg.yaml needs about 300; a model that fits stops early
OVERFIT_SECONDS = 20.0  # the overfit check gives up after this long (the whole check aims at < 30 s on CPU)
LABEL_SAMPLES = 1024  # train samples whose labels are checked (the first batch alone may miss a class)
MEMORIZED_EVERY = 10  # the overfit check compares the batch's predictions with its labels every N steps
VAL_SAMPLES = 8  # validation samples read twice to see whether they change


@dataclass
class Finding:
    """One check's verdict: ``ok`` False is a problem that makes ``sweeps check`` exit 2."""

    check: str  # data, labels, validation, finite, model, input, torchscript, overfit
    ok: bool
    message: str


def sanity_check(task: Task, cfg: TrainConfig, batch_size: int = 16, steps: int = OVERFIT_STEPS,
                 factor: float = 10.0) -> list[Finding]:
    """Every check on ``task`` (its model and data built as ``core.train`` builds them, on CPU)."""
    seed_everything(cfg.seed)
    lacking = classes_lacking(task)
    if lacking:  # every trial would fail at its first line
        return [Finding("task", False, lacking)]
    hook = "datasets()"
    try:  # a hook that raises is the finding (missing data, a typo in the model), not a crash
        train_ds, val_ds = task.datasets()
        hook = "build_model()"
        task.build_model()
        hook = "make_loss(cfg)"
        task.make_loss(cfg)
    except Exception as exc:  # noqa: BLE001 - whatever the task's code raises
        return [Finding("data" if hook == "datasets()" else "model", False, _hook_failed(hook, exc))]
    try:
        x, y = _first_batch(task, train_ds, batch_size)
        vx, vy = _first_batch(task, val_ds, batch_size)
        labels = torch.cat([b for _, b in itertools.islice(_batches(task, train_ds, 256), LABEL_SAMPLES // 256)])
    except Exception as exc:  # noqa: BLE001 - a dataset or collate_fn that fails is the finding
        return [Finding("data", False, f"reading the first batches failed: {type(exc).__name__}: {exc}; "
                                       f"fix the task's datasets() or collate_fn")]
    findings = [_shapes(task, x, vx), _labels(task, cfg, labels, vy), _validation_repeats(task, val_ds)]
    findings.append(_finite(task, train_ds, val_ds, x, vx))
    findings += _model(task, cfg, x, y)
    if cfg.export_torchscript and isinstance(x, torch.Tensor):  # found now, not after a whole trial
        findings.append(_torchscript(task, cfg, x))
    if all(f.ok for f in findings):  # overfitting a broken pipeline would only repeat its problem
        findings.append(_overfit(task, cfg, _head(x), _head(y), steps, factor))
    return findings


def _hook_failed(hook: str, exc: Exception) -> str:
    """A task hook's exception in one line: a TaskError's message already says the fix."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, TaskError):
        return f"task.{hook}: {text}"
    return f"task.{hook} raised {type(exc).__name__}: {text}; fix the task's {hook.split('(')[0]}()"


def _head(batch: Any) -> Any:
    """The first OVERFIT_SAMPLES samples of a batch: a tensor, or a dict, list or tuple of them."""
    if isinstance(batch, torch.Tensor):
        return batch[:OVERFIT_SAMPLES]
    if isinstance(batch, dict):
        return {k: _head(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_head(v) for v in batch)
    return batch


def _batches(task: Task, ds: Dataset, batch_size: int) -> Any:
    return iter(DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=task.collate_fn))


def _first_batch(task: Task, ds: Dataset, batch_size: int) -> tuple[Any, torch.Tensor]:
    x, y = next(_batches(task, ds, batch_size))
    return x, y


def _shape(x: Any) -> tuple[int, ...] | None:
    return tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else None


def _shapes(task: Task, x: Any, vx: Any) -> Finding:
    train_shape, val_shape = _shape(x), _shape(vx)
    if train_shape != val_shape:
        return Finding("data", False, f"train inputs are shaped {train_shape} per sample but validation inputs "
                                      f"{val_shape}; give both splits the same preprocessing in datasets()")
    if task.input_shape and train_shape is not None and tuple(task.input_shape) != train_shape:
        return Finding("data", False, f"task.input_shape is {tuple(task.input_shape)} but datasets() yields "
                                      f"samples shaped {train_shape}; set input_shape to what the model takes")
    return Finding("data", True, f"inputs shaped {train_shape} per sample in both splits")


def _labels(task: Task, cfg: TrainConfig, y: torch.Tensor, vy: Any) -> Finding:
    """Class labels of the first train samples and of the first validation batch (a label out of
    range there fails the trial at its first validation, an epoch of training later)."""
    if not isinstance(y, torch.Tensor) or y.is_floating_point():
        return Finding("labels", True, "not class indices: range not checked")
    if task.num_classes <= 0 and y.numel():
        return Finding("labels", True, f"integer labels ({int(y.min())}..{int(y.max())} in the first {y.shape[0]} "
                                       f"train samples) but num_classes is {task.num_classes}: range not checked "
                                       f"(set num_classes to check it)")
    ignore = getattr(task.make_loss(cfg), "ignore_index", None)
    ranges = []
    for split, t in (("train", y), ("validation", vy)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point():
            continue
        labels = t[t != ignore] if ignore is not None else t
        if not labels.numel():
            continue
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= task.num_classes:
            return Finding("labels", False, f"labels of the first {t.shape[0]} {split} samples span {low}..{high} "
                                            f"but num_classes is {task.num_classes}: "
                                            f"labels must be 0..{task.num_classes - 1}; fix the labels in "
                                            f"datasets() or the task's num_classes")
        ranges.append(f"the first {t.shape[0]} {split} samples: {low}..{high}")
    return Finding("labels", True, f"labels of {'; of '.join(ranges)}, within 0..{task.num_classes - 1}")


def _read_twice(ds: Dataset, read: Callable[[], list[Any]]) -> tuple[list[Any], list[Any]]:
    """Read the same samples under two different seeds: a random transform gives two answers."""
    seed_everything(1)
    first = read()
    seed_everything(2)
    return first, read()


def _finite(task: Task, train_ds: Dataset, val_ds: Dataset, x: Any, vx: Any) -> Finding:
    """No NaN or infinity in the data: every value of an in-memory dataset (as ``core.train``
    refuses it before any step), else the first batch of each split."""
    for which, ds, batch in (("train", train_ds, x), ("validation", val_ds, vx)):
        problem = nonfinite_problem(task, ds, which)
        if problem:
            return Finding("finite", False, problem)
        count = nonfinite_count(tensor_stats(batch))
        if count:
            return Finding("finite", False, f"the first batch of the {which} dataset holds {count} NaN or infinite "
                                            f"values: a problem of the data (every step on them gives a non-finite "
                                            f"loss); drop or repair those samples in datasets()")
    whole = stored_tensors(train_ds) and stored_tensors(val_ds)  # in memory: every value was checked
    return Finding("finite", True, "no NaN or infinite value in the data" if whole else
                   "no NaN or infinite value in the first batch of each split")


def _validation_repeats(task: Task, val_ds: Dataset) -> Finding:
    if isinstance(val_ds, IterableDataset):
        def read() -> list[Any]:
            return [x for x, _ in itertools.islice(iter(val_ds), VAL_SAMPLES)]
    else:
        n = min(VAL_SAMPLES, len(val_ds))  # type: ignore[arg-type]  # map-style: check_datasets asks for it

        def read() -> list[Any]:
            return [val_ds[i][0] for i in range(n)]
    first, second = _read_twice(val_ds, read)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not torch.equal(a, b):
            return Finding("validation", False, f"validation sample {i} differs each time it is read: random "
                                                f"augmentation is applied to validation; give the validation "
                                                f"dataset a deterministic transform in datasets()")
    return Finding("validation", True, "validation samples are the same each time they are read")


def _model(task: Task, cfg: TrainConfig, x: Any, y: torch.Tensor) -> list[Finding]:
    seed_everything(cfg.seed)
    model = task.build_model()
    criterion = task.make_loss(cfg)
    try:
        if task.checkpoint_blocks:  # as core.train applies them: a wrong block name is found here
            checkpoint_blocks(model, task.checkpoint_blocks, task.name)
        model.train()
        out = model(x)
        loss = criterion(out, y)
        loss.backward()
        out, loss = out.detach(), loss.detach()
    except Exception as exc:  # noqa: BLE001 - a forward/backward that fails is the finding
        return [Finding("model", False, f"forward/backward on a train batch failed: {type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0] if str(exc) else ''}; fix the model or loss")]
    findings = []
    if not bool(torch.isfinite(out).all()) or not math.isfinite(float(loss)):
        findings.append(Finding("model", False, f"the first forward gives a non-finite output or loss "
                                                f"({float(loss)}); check the model's initialisation and the inputs"))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if bad:
        findings.append(Finding("model", False, f"non-finite gradients in {', '.join(bad[:5])}"))
    if missing:
        findings.append(Finding("model", False, f"parameters {', '.join(missing[:5])} get no gradient: they take "
                                                f"no part in the loss; remove them or set requires_grad=False"))
    if not findings:
        findings.append(Finding("model", True, f"forward/backward ok: loss {float(loss):.4g}, output "
                                               f"{tuple(out.shape)}"))
    findings.append(_depends_on_input(model, x))
    return findings


def _depends_on_input(model: nn.Module, x: Any) -> Finding:
    """Outputs of different samples must differ (in eval mode: no dropout, fixed normalisation)."""
    if not isinstance(x, torch.Tensor) or x.shape[0] < 2 or bool((x == x[:1]).all()):
        return Finding("input", True, "not checked: the batch has no two different inputs")
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    spread = float((out - out[:1]).abs().max())
    if spread <= 1e-6 * max(float(out.abs().max()), 1.0):
        return Finding("input", False, "the model gives the same output for every input of a batch: it ignores "
                                       "its input (check that forward uses its argument, not a constant or a "
                                       "stored tensor)")
    return Finding("input", True, "the output depends on the input")


def _torchscript(task: Task, cfg: TrainConfig, x: torch.Tensor) -> Finding:
    import tempfile

    assert cfg.export_torchscript is not None  # the caller checks it
    with tempfile.TemporaryDirectory(prefix="sweeps-check-") as tmp:
        try:
            report = export_torchscript(task.build_model(), x, f"{tmp}/model.ts", cfg.export_torchscript,
                                        cfg.onnx_tolerance)
        except TorchScriptError as exc:
            return Finding("torchscript", False, str(exc))
    if not report.passed:
        return Finding("torchscript", False, report.error)
    return Finding("torchscript", True, f"{cfg.export_torchscript} export matches eager "
                                        f"(max diff {report.max_abs_diff:.3g})")


def _memorized(task: Task, model: nn.Module, x: Any, y: torch.Tensor) -> bool:
    """Whether the task's predictions (``postprocess``) on the batch equal its class labels."""
    if not isinstance(y, torch.Tensor) or y.is_floating_point():  # not class labels (a regression)
        return False
    with torch.no_grad():
        predicted = task.postprocess(model(x))
    return predicted.shape == y.shape and bool((predicted == y).all())


def _overfit(task: Task, cfg: TrainConfig, x: Any, y: torch.Tensor, steps: int, factor: float) -> Finding:
    seed_everything(cfg.seed)
    model = task.build_model()
    model.train()
    # Hard labels: label smoothing puts a floor under the loss (about 0.5 for 10 classes at 0.1) that
    # a 10x fall cannot pass, however well the model fits.
    criterion = task.make_loss(dataclasses.replace(cfg, label_smoothing=0.0))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=OVERFIT_LR)
    first = last = math.nan
    deadline = time.monotonic() + OVERFIT_SECONDS
    step = 0
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        last = float(loss.detach())
        if step == 1:
            first = last
        if last <= first / factor:
            return Finding("overfit", True, f"one batch overfits: loss {first:.4g} -> {last:.4g} in {step} steps")
        if last < first and step % MEMORIZED_EVERY == 0 and _memorized(task, model, x, y):
            # A few classes start at a low loss (ln 3 = 1.1) and a linear model's loss falls slowly
            # once every sample is right: predicting the whole batch right is the fit asked for.
            return Finding("overfit", True, f"one batch overfits: every one of its {y.shape[0]} samples predicted "
                                            f"right after {step} steps (loss {first:.4g} -> {last:.4g})")
        if time.monotonic() > deadline:  # too slow here to tell: say so rather than fail a model that may fit
            return Finding("overfit", True, f"inconclusive: loss {first:.4g} -> {last:.4g} in {step} steps when the "
                                            f"{OVERFIT_SECONDS:g} s limit ran out, short of {factor:g}x (a busy or "
                                            f"slow CPU; a GPU-sized model)")
    return Finding("overfit", False, f"the loss on one fixed batch of {y.shape[0]} fell only from {first:.4g} to "
                                     f"{last:.4g} in {step} steps (Adam, lr {OVERFIT_LR}), not by {factor:g}x: "
                                     f"the model cannot fit its data; check the labels match the inputs, the "
                                     f"loss and the output layer (or pass --steps / --factor)")
