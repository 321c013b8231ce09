"""Export a trained model to ONNX and prove onnxruntime computes the same logits.

Exporters: the TorchScript one (``torch.onnx.export(dynamo=False)``) first, where it captures
the model faithfully: a fraction of a second for a small model where the torch.export-based
("dynamo") exporter takes seconds (benchmarks/README.md), which in a study of short trials was
a large share of every trial. A trace follows one path through the code, so a trace that met
data-dependent Python (a tensor turned into a Python bool or number, which
``torch.jit.TracerWarning`` reports) is not used: such a model, and any the TorchScript exporter
cannot handle, goes to the dynamo exporter (torch's default since 2.9, the maintained one; it
needs onnxscript). Whichever exported it, the model passes the same checks before it is written:
``onnx.checker``, a dynamic batch axis, and onnxruntime's logits against PyTorch's on real
inputs at two batch sizes. ``exporter="dynamo"`` or ``"torchscript"`` asks for one; the report
names the one used. Opset: the exporter's default unless ``opset`` is given.

The file at ``path`` only ever holds a verified model: export, ``onnx.checker`` and the
parity check all run in a temporary folder next to ``path``; the files are moved into place
only after they pass. A temporary *folder* rather than a file because the exporter writes
weights of models over 2 GB to a separate ``<name>.data`` file referenced by relative name,
so the model must be written under its final name from the start.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.io_utils import fsync_dir, save_json_atomic
from core.results import OnnxReport

__all__ = ["OnnxParityError", "export_and_verify", "read_metadata", "set_metadata", "write_report_json"]

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
MAX_CHECK_SAMPLES = 256  # enough to catch a wrong op, few enough to check in seconds on CPU
LATENCY_BATCH = 64
LATENCY_RUNS = 5

# torch.onnx.export builds its registry of ATen -> ONNX functions anew on every call: hundreds of
# torchlib functions, each parsed from its Python source, a large share of a small model's export
# (benchmarks/README.md, parallel efficiency). Without a custom translation table
# (we pass none) nothing changes the registry once built, so one per opset serves every export
# of the process. Keyed by the opset the exporter asks for; guarded, as exports may run in threads.
_registries: dict[object, object] = {}
_export_lock = threading.Lock()


class OnnxParityError(RuntimeError):
    """onnxruntime's outputs differ from PyTorch's by more than the tolerance.

    ``report`` holds the measured difference; the model was not written to ``report.path``.
    """

    def __init__(self, report: OnnxReport) -> None:
        super().__init__(
            f"ONNX parity check failed: max |onnxruntime - torch| = {report.max_abs_diff:.3g} "
            f"> tolerance {report.tolerance:.3g} over {report.n_inputs_checked} inputs; "
            f"{report.path} was not written"
        )
        self.report = report


def export_and_verify(model: nn.Module, sample_inputs: torch.Tensor, path: str | os.PathLike,
                      tolerance: float = 1e-4, opset: int | None = None, *,
                      max_samples: int = MAX_CHECK_SAMPLES, latency_runs: int = LATENCY_RUNS,
                      exporter: str = "auto") -> OnnxReport:
    """Export ``model`` to ``path`` (input ``"input"``, output ``"logits"``, dynamic batch axis).

    ``sample_inputs`` are real inputs (a batch, e.g. validation images); the first
    ``max_samples`` are run through PyTorch and onnxruntime (CPUExecutionProvider) at two
    different batch sizes, which also proves the batch axis is dynamic. Latency is the median
    of ``latency_runs`` forwards at batch ``min(64, n)`` in each runtime, on the same threads.

    The caller's model is neither moved nor switched to eval mode: a deep copy is exported
    on the CPU in fp32. Raises :class:`OnnxParityError` (carrying the report) when the max
    absolute difference exceeds ``tolerance``; ``path`` is then left as it was.
    """
    import onnx
    import onnxruntime as ort

    if not isinstance(sample_inputs, torch.Tensor) or sample_inputs.ndim < 1 or len(sample_inputs) == 0:
        raise ValueError("export_and_verify: sample_inputs must be a non-empty batch tensor (N, ...)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu_model = _cpu_eval_copy(model)
    inputs = sample_inputs[:max_samples].detach().to("cpu").contiguous()
    if inputs.is_floating_point():  # fp32 like the copied model; integer inputs (ids) stay as they are
        inputs = inputs.float()
    n = len(inputs)

    tmp_dir = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        tmp_path = tmp_dir / path.name
        used_exporter = _export(cpu_model, inputs, tmp_path, opset, exporter)
        onnx.checker.check_model(str(tmp_path))  # by path: works for external-data models too
        proto = onnx.load(str(tmp_path), load_external_data=False)
        _check_dynamic_batch(proto)
        used_opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))

        session = _ort_session(ort, tmp_path)
        with torch.inference_mode():
            big = min(LATENCY_BATCH, n)
            small = big // 2 + 1 if big > 1 else 1  # a second, different size (ragged chunks too)
            reference = torch.cat([cpu_model(inputs[i:i + big]) for i in range(0, n, big)]).numpy()
        max_diff = 0.0
        for batch in dict.fromkeys((big, small)):  # ordered and deduplicated (n == 1)
            got = np.concatenate([_run_ort(session, inputs[i:i + batch].numpy()) for i in range(0, n, batch)])
            if got.shape != reference.shape:
                raise RuntimeError(f"ONNX model returned shape {got.shape} at batch {batch}, torch {reference.shape}")
            # NaN-aware: a NaN on either side must fail the check, not compare as "no difference".
            diff = np.abs(got.astype(np.float64) - reference.astype(np.float64))
            max_diff = max(max_diff, float("inf") if not np.isfinite(diff).all() else float(diff.max()))

        torch_ms, ort_ms = _latency_ms(cpu_model, session, inputs[:big], latency_runs)
        report = OnnxReport(path=path, max_abs_diff=max_diff, tolerance=float(tolerance),
                            passed=max_diff <= tolerance, n_inputs_checked=n,
                            torch_latency_ms=torch_ms, ort_latency_ms=ort_ms, opset=int(used_opset),
                            exporter=used_exporter)
        del session  # release the file before moving it (matters on Windows)
        if not report.passed:
            raise OnnxParityError(report)
        _publish(tmp_dir, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    log.info("exported %s: opset %d, max diff %.3g, latency torch %.2f ms / onnxruntime %.2f ms",
             path, report.opset, report.max_abs_diff, report.torch_latency_ms, report.ort_latency_ms)
    return report


def write_report_json(report: OnnxReport, path: str | os.PathLike) -> Path:
    """Write ``report.to_dict()`` as JSON, atomically."""
    return save_json_atomic(report.to_dict(), path)


def set_metadata(path: str | os.PathLike, props: dict[str, str]) -> None:
    """Write ``props`` into the ONNX file's ``metadata_props`` (a key given replaces the one there),
    in place, atomically. The graph and weights are untouched: onnxruntime computes the same."""
    import onnx

    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)  # external weights stay where they are
    kept = [p for p in proto.metadata_props if p.key not in props]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, value in props.items():
        proto.metadata_props.add(key=key, value=value)
    tmp = path.with_name(f".{path.name}.meta.tmp")
    onnx.save_model(proto, str(tmp))
    os.replace(tmp, path)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ONNX file's ``metadata_props`` as a dict."""
    import onnx

    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


# --------------------------------------------------------------------------- helpers


def _cpu_eval_copy(model: nn.Module) -> nn.Module:
    """A CPU, fp32, eval-mode deep copy of the user model inside any DDP/compile wrapper."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        inner = inner.module
    inner = getattr(inner, "_orig_mod", inner)
    # Pre-seed deepcopy's memo with CPU copies of every tensor: a plain deepcopy of a CUDA
    # model would first allocate a second full copy on the (possibly nearly full) GPU.
    memo: dict[int, object] = {}
    for p in inner.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False)
    for b in inner.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    copied = copy.deepcopy(inner, memo)
    # fp32: a model left in bf16/fp16 would be compared at half precision, and ORT's CPU
    # provider lacks most half-precision kernels.
    return copied.to("cpu").float().eval()


EXPORTERS = ("auto", "torchscript", "dynamo")


def _export(model: nn.Module, inputs: torch.Tensor, dest: Path, opset: int | None, exporter: str) -> str:
    """Export to ``dest`` with ``exporter`` ("auto": TorchScript where its trace is faithful, else
    dynamo). Returns the name of the exporter that wrote the file."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, not {exporter!r}")
    # torch.export specialises a dimension whose example size is 0 or 1, so trace with >= 2 samples.
    example = inputs[:2] if len(inputs) >= 2 else inputs.repeat(2, *([1] * (inputs.ndim - 1)))
    if exporter == "dynamo":
        _export_dynamo(model, example, dest, opset)
        return "dynamo"
    try:
        _export_torchscript(model, example, dest, opset, strict=exporter == "auto")
        import onnx

        # A trace can fix the batch size without a warning (a size read as a Python int).
        _check_dynamic_batch(onnx.load(str(dest), load_external_data=False))
        return "torchscript"
    except Exception as exc:  # noqa: BLE001 - trace and export failures surface as many types
        if exporter == "torchscript":
            raise
        traced_exc = exc
        why = str(traced_exc).splitlines()[0] if str(traced_exc) else type(traced_exc).__name__
        log.info("TorchScript export not used (%s); exporting with the dynamo exporter", why)
        _clear(dest.parent)
    try:
        _export_dynamo(model, example, dest, opset)
        return "dynamo"
    except Exception as dynamo_exc:  # noqa: BLE001 - raised again with both causes
        if not _from_a_tracer_warning(traced_exc):
            raise RuntimeError(f"ONNX export failed with both exporters: torchscript: {why}; "
                               f"dynamo: {dynamo_exc}") from dynamo_exc
        # Data-dependent Python that torch.export cannot capture either: the trace (one path through
        # it) is the only export there is. The parity check below decides whether it stands.
        log.warning("torch.export cannot capture the model (%s) and its TorchScript trace follows one path "
                    "through data-dependent code (%s); exporting that trace, verified on real inputs",
                    str(dynamo_exc).splitlines()[0] if str(dynamo_exc) else type(dynamo_exc).__name__, why)
        _clear(dest.parent)
        _export_torchscript(model, example, dest, opset, strict=False)
        return "torchscript"


def _export_torchscript(model: nn.Module, example: torch.Tensor, dest: Path, opset: int | None,
                        strict: bool = True) -> None:
    """``strict``: a trace that turned a tensor into a Python value (one branch baked in) raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter is deprecated; see above
        warnings.simplefilter("error" if strict else "ignore", torch.jit.TracerWarning)
        torch.onnx.export(
            model, (example,), str(dest), input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            opset_version=opset, dynamo=False,
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )


def _export_dynamo(model: nn.Module, example: torch.Tensor, dest: Path, opset: int | None) -> None:
    with _reused_registry():
        torch.onnx.export(
            model, (example,), str(dest), input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
            opset_version=opset, dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=False, verbose=False, artifacts_dir=str(dest.parent),
        )


def _from_a_tracer_warning(exc: BaseException | None) -> bool:
    """Whether the trace was refused for a ``TracerWarning`` (raised from C++, it arrives
    wrapped, e.g. in a ``SystemError``, with the warning as its context)."""
    while exc is not None:
        if isinstance(exc, torch.jit.TracerWarning):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _clear(folder: Path) -> None:
    """Remove a failed export's partial output or error report."""
    for leftover in folder.iterdir():
        if leftover.is_file():
            leftover.unlink()


def _registry_class():
    """torch.onnx's ``ONNXRegistry`` and its ``from_torchlib`` classmethod, or None where this
    torch has no such private API (then every export builds its own, as torch does)."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        return None
    cls = _registration.ONNXRegistry
    builder = cls.__dict__.get("from_torchlib")
    return (cls, builder) if isinstance(builder, classmethod) else None


def _cached_registry(cls, builder: classmethod, opset_version: int):
    if opset_version not in _registries:
        _registries[opset_version] = builder.__func__(cls, opset_version=opset_version)
    return _registries[opset_version]


@contextlib.contextmanager
def _reused_registry():
    """Within: ``ONNXRegistry.from_torchlib`` returns the registry it built for that opset before."""
    found = _registry_class()
    if found is None:
        yield
        return
    cls, builder = found
    from torch.onnx._internal.exporter import _constants

    def from_torchlib(klass, opset_version=_constants.TORCHLIB_OPSET):
        return _cached_registry(klass, builder, opset_version)

    with _export_lock:
        cls.from_torchlib = classmethod(from_torchlib)
        try:
            yield
        finally:
            cls.from_torchlib = builder


def _check_dynamic_batch(proto) -> None:
    """Fail early if the exporter fixed the batch size, with a clearer message than ORT's."""
    inputs = [i for i in proto.graph.input if i.name == INPUT_NAME]
    if not inputs:
        raise RuntimeError(f"exported ONNX model has no input named {INPUT_NAME!r}")
    outputs = [o for o in proto.graph.output if o.name == OUTPUT_NAME]
    for value in inputs + outputs:
        dims = value.type.tensor_type.shape.dim
        if dims and not dims[0].dim_param:
            raise RuntimeError(f"exported ONNX model has a fixed batch size {dims[0].dim_value} in {value.name!r}; "
                               "expected a dynamic axis")


def _ort_session(ort, model_path: Path):
    opts = ort.SessionOptions()
    # Same thread budget as torch, so the latency comparison is fair and a trial does not
    # oversubscribe the CPUs it shares with other trials.
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3  # errors only; ORT warns about unused initializers otherwise
    return ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])


def _run_ort(session, batch: np.ndarray) -> np.ndarray:
    """onnxruntime forward for one batch (a separate function so tests can substitute it)."""
    return session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]


def _latency_ms(model: nn.Module, session, batch: torch.Tensor, runs: int) -> tuple[float, float]:
    """Median wall time in ms of one forward in PyTorch eager and in onnxruntime (after a warm-up)."""
    runs = max(1, runs)
    arr = batch.numpy()
    with torch.inference_mode():
        model(batch)  # warm-up: first calls allocate and pick kernels
        torch_ms = median_ms(lambda: model(batch), runs)
    _run_ort(session, arr)
    ort_ms = median_ms(lambda: _run_ort(session, arr), runs)
    return torch_ms, ort_ms


def median_ms(fn, calls: int) -> float:
    """Median wall time in ms of ``calls`` calls of ``fn`` (also the latency benchmark's measure)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def _publish(tmp_dir: Path, path: Path) -> None:
    """Move the verified files into ``path.parent``; the .onnx file last, once its data is in place."""
    files = sorted(tmp_dir.iterdir(), key=lambda p: p.name == path.name)
    for f in files:
        if not f.is_file():
            continue
        with open(f, "rb") as fh:  # the exporter does not fsync; do it before the rename
            os.fsync(fh.fileno())
        os.replace(f, path.parent / f.name)
    fsync_dir(path.parent)
