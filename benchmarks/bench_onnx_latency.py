"""ONNX Runtime against PyTorch eager: inference latency at batch 1 and 64 on CPU.

Models: the digits CNN and ResNet-18 (CIFAR-style, 32x32), freshly initialised, eval mode.
Exported with ``core.onnx_export.export_and_verify`` (the path a trial takes: dynamo exporter,
checker, parity check against PyTorch); the ORT session uses ``CPUExecutionProvider`` with the
same intra-op thread count as torch (as ``core.onnx_export`` does). PyTorch runs under
``torch.inference_mode()``.

Per round: a block of calls in PyTorch, then a block in ORT (ABAB); each block's latency is the
median call; the ratio (torch ms / ORT ms, > 1 means ORT is faster) is taken inside each round.
"""
from __future__ import annotations

import statistics
import time

from benchmarks.common import Context, arm, make_row, paired_ratio
from core.onnx_export import median_ms

NAME = "onnx_latency"
TITLE = "ONNX Runtime vs PyTorch eager inference latency (CPU, batch 1 and 64)"

MODELS = {
    "digits_cnn": ("digits", {"model": "cnn"}, (1, 8, 8)),
    "resnet18": ("synthetic", {"model": "resnet18", "shape": [3, 32, 32], "n_train": 8, "n_val": 8}, (3, 32, 32)),
}


def _torch_block_ms(model, x, calls: int) -> float:
    import torch

    with torch.inference_mode():
        return median_ms(lambda: model(x), calls)


def _ort_block_ms(session, arr, calls: int) -> float:
    return median_ms(lambda: session.run(["logits"], {"input": arr}), calls)


def run(ctx: Context) -> dict:
    import onnxruntime as ort
    import torch

    from benchmarks.bench_trainer_overhead import make_task
    from core.onnx_export import export_and_verify

    models = ctx.options.get("models", ctx.pick(["digits_cnn"], list(MODELS)))  # quick: the same code, one export
    batches = ctx.options.get("batches", (1, 64))
    repeats = ctx.n_repeats(7)
    warmup = ctx.pick(0, 1)
    rows, exports = [], {}
    threads = ctx.torch_threads()
    for model_name in models:
        task_name, args, shape = MODELS[model_name]
        torch.manual_seed(0)
        model = make_task((task_name, args)).build_model().eval()
        heavy = sum(p.numel() for p in model.parameters()) > 1_000_000
        ctx.log(f"{NAME}: exporting {model_name}")
        t0 = time.perf_counter()
        sample = torch.randn(64, *shape, generator=torch.Generator().manual_seed(0))
        report = export_and_verify(model, sample, ctx.workdir / f"{model_name}.onnx", max_samples=64, latency_runs=1)
        exports[model_name] = {"export_s": time.perf_counter() - t0, "opset": report.opset,
                               "max_abs_diff": report.max_abs_diff, "parity_passed": report.passed}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(ctx.workdir / f"{model_name}.onnx"), sess_options=opts,
                                       providers=["CPUExecutionProvider"])
        for batch in batches:
            x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(1))
            arr = x.numpy()
            calls = ctx.pick(3, (10 if batch > 1 else 30) if heavy else (30 if batch > 1 else 200))
            # First calls allocate and pick kernels; they also time one call of each side, so that a
            # round (a block of each) is sized to fit in what is left of the time budget.
            t_warm = time.perf_counter()
            _torch_block_ms(model, x, 2)
            _ort_block_ms(session, arr, 2)
            per_pair_s = (time.perf_counter() - t_warm) / 2
            share = ctx.time_left() / (4 * (len(batches) * (len(models) - models.index(model_name))))
            if calls * per_pair_s > share:
                fit = max(3, int(share / per_pair_s))
                if fit < calls:
                    ctx.cut.append(f"{model_name} batch {batch}: {fit} calls per block instead of {calls} "
                                   f"(a round of {calls} would take about {calls * per_pair_s:.0f} s)")
                    calls = fit
            vals: dict[str, list[float]] = {"torch": [], "ort": []}
            last = 0.0
            for r in range(warmup + repeats):
                if r - warmup >= 1 and not ctx.can_afford(1.1 * last, f"{model_name} batch {batch}: rounds "
                                                                       f"{r - warmup + 1}-{repeats}"):
                    break
                t_round = time.perf_counter()
                t_ms, o_ms = _torch_block_ms(model, x, calls), _ort_block_ms(session, arr, calls)
                last = time.perf_counter() - t_round
                if r >= warmup:
                    vals["torch"].append(t_ms)
                    vals["ort"].append(o_ms)
            ratio = paired_ratio(vals["torch"], vals["ort"], "torch eager ms / onnxruntime ms (per round)")
            ctx.log(f"  {model_name} batch {batch}: torch {statistics.median(vals['torch']):.3f} ms, "
                    f"ORT {statistics.median(vals['ort']):.3f} ms")
            rows.append(make_row(
                f"{model_name} batch {batch}", metric="ms per forward (median of a block)",
                baseline=arm("PyTorch eager", vals["torch"]), candidate=arm("onnxruntime CPU", vals["ort"]),
                ratio=ratio,
                headline=f"ORT {statistics.median(vals['ort']):.3f} ms "
                         f"vs torch {statistics.median(vals['torch']):.3f} ms "
                         f"({ratio['median']:.2f}x {'faster' if ratio['median'] >= 1 else 'as fast'})",
                details={"calls_per_block": calls, "threads": threads, "export": exports[model_name]}))
            ctx.keep(rows)
    bits = [f"{r['case']} {r['ratio']['median']:.2f}x" for r in rows]
    return {
        "target": "none (reported): torch eager ms / onnxruntime ms",
        "summary": "ONNX Runtime speed-up over PyTorch eager (latency ratio, CPU): " + ", ".join(bits),
        "rows": rows,
        "notes": [f"{threads} intra-op threads on both sides; random weights and inputs; "
                  "export through core.onnx_export.export_and_verify (parity checked)."],
        "details": {"exports": exports},
    }

