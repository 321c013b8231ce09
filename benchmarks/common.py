"""What every benchmark shares: statistics, ABAB alternation, machine facts, load monitoring and
the result schema. Running the real ``sweeps`` CLI and MLflow stores: ``benchmarks/sweeps_runs.py``.

Result schema (one JSON file per benchmark, ``benchmarks/results/<name>.json``)::

    {"schema": 1, "name": str, "title": str, "mode": "full" | "quick",
     "status": "ok" | "error" | "skipped", "error": str | None,
     "started_at": ISO-8601 UTC, "wall_s": float,
     "machine": {...},                      # machine_info()
     "load": {...},                         # CpuMonitor.result(): other processes' CPU use
     "target": str, "summary": str,         # one line each
     "rows": [row, ...], "notes": [str], "details": {...}}

    row = {"case": str, "status": "ok" | "error", "error": str | None,
           "metric": str,                   # what baseline and candidate measure (e.g. "samples/s")
           "baseline": {"label": str, **stats} | None, "candidate": {"label": str, **stats} | None,
           "ratio": {**stats, "definition": str} | None,   # paired: one ratio per ABAB pair
           "headline": str,                 # the figure to read, in words
           "target": str | None, "meets_target": bool | None, "details": {...}}

    stats = {"median", "min", "max", "q1", "q3", "n"}   (see :func:`stats`)

A benchmark never fails on speed: a target that is missed is ``meets_target: false``; an
exception inside a benchmark becomes ``status: "error"`` with the traceback, and the suite goes on.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
SCHEMA_VERSION = 1
VERSION_PACKAGES = ("torch", "torchvision", "optuna", "mlflow", "ray", "onnxruntime", "onnx", "numpy")

if str(ROOT) not in sys.path:  # the benchmarks import `core` and `sweeps` from this checkout
    sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------- context


@dataclass
class Context:
    """What a benchmark's ``run(ctx)`` gets: the mode, an optional repeat override, a scratch folder."""

    quick: bool = False
    repeats: int | None = None  # overrides the benchmark's own default (full: several; quick: 1)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sweeps-bench-")))
    options: dict = field(default_factory=dict)  # benchmark-specific knobs (tests use them to shrink cases)
    budget_s: float | None = None  # soft time budget: optional repeats are dropped to stay within it
    t_start: float = field(default_factory=time.monotonic)
    cut: list = field(default_factory=list)  # what was dropped for the budget (reported in the notes)
    on_rows: Callable[[list], None] | None = None  # bench_main: saves the rows so far (see keep)
    closers: list = field(default_factory=list)  # called before the scratch folder is removed

    def closing(self, obj):
        """Close ``obj`` when the benchmark ends, before its scratch folder goes (a tracker
        sends what it still buffers into the store there)."""
        self.closers.append(obj.close)
        return obj

    def keep(self, rows: list) -> None:
        """Save the rows measured so far: if the suite stops this benchmark at its hard time limit
        (run_all.py), they are reported instead of nothing. Call after each finished row."""
        if self.on_rows is not None:
            self.on_rows(list(rows))

    def time_left(self) -> float:
        if self.budget_s is None:
            return math.inf
        return self.budget_s - (time.monotonic() - self.t_start)

    def can_afford(self, seconds: float, what: str) -> bool:
        """False (and noted) when ``seconds`` more would overrun the budget."""
        if seconds <= self.time_left():
            return True
        self.cut.append(f"{what} (about {seconds:.0f} s) left out: {max(0.0, self.time_left()):.0f} s of the "
                        f"{self.budget_s:.0f} s time budget left")
        return False

    def torch_threads(self, default: int = 1) -> int:
        """Set torch's intra-op threads for an in-process timing benchmark (``--opt threads=N``).

        Default 1: on a 2-core machine that other processes also use, two threads per process
        wait on each other at every op whenever another process holds a core, and timings swing
        tenfold; one thread is only time-sliced, which the paired ABAB ratios absorb."""
        import torch

        n = int(self.options.get("threads", default))
        torch.set_num_threads(n)
        return n

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    def n_repeats(self, full: int) -> int:
        if self.repeats is not None:
            return max(1, self.repeats)
        return 1 if self.quick else full

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- statistics


def stats(values: Iterable[float]) -> dict:
    """Median, min, max and quartiles (inclusive method) of ``values``; NaN-free input expected."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "q1": math.nan, "q3": math.nan, "n": 0}
    if len(vals) == 1:
        q1 = q3 = vals[0]
    else:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3,
            "n": len(vals)}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float], definition: str) -> dict:
    """Stats of the per-pair ratios ``numerators[i] / denominators[i]`` (pairs from one ABAB round,
    so slow drift of the machine cancels inside each ratio)."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True) if d]
    return {**stats(ratios), "definition": definition}


def alternate(arms: Mapping[str, Callable[[], float]], repeats: int, warmup: int = 1,
              log: Callable[[str], None] | None = None, ctx: Context | None = None,
              what: str = "rounds", budget_s: float | None = None) -> dict[str, list[float]]:
    """Run the arms round-robin (A B A B ... or A B C A B C ...) ``warmup + repeats`` times and
    return each arm's measured values (the first ``warmup`` rounds are discarded). With a ``ctx``
    that has a time budget, rounds after the second measured one are dropped when the budget
    cannot pay for another (the drop is noted in ``ctx.cut``); ``budget_s`` caps this call alone.
    The first measured round always runs."""
    values: dict[str, list[float]] = {name: [] for name in arms}
    last = 0.0
    t0 = time.monotonic()
    for r in range(warmup + repeats):
        measured = r - warmup
        if ctx is not None and measured >= 1:
            need = 1.1 * last
            if budget_s is not None and time.monotonic() - t0 + need > budget_s:
                ctx.cut.append(f"{what}: rounds {measured + 1}-{repeats} left out (its share of the time budget, "
                               f"{budget_s:.0f} s, was spent)")
                break
            if not ctx.can_afford(need, f"{what}: rounds {measured + 1}-{repeats}"):
                break
        t_round = time.monotonic()
        for name, fn in arms.items():
            v = float(fn())
            if r >= warmup:
                values[name].append(v)
            if log:
                log(f"  {'warm-up' if r < warmup else f'round {r - warmup + 1}/{repeats}'} {name}: {v:.6g}")
        last = time.monotonic() - t_round
    return values


def arm(label: str, values: Sequence[float]) -> dict:
    return {"label": label, **stats(values)}


def fmt_stats(s: Mapping[str, Any] | None, digits: int = 3) -> str:
    """``median [min, max]`` in a short form for tables."""
    if not s or not s.get("n"):
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}g}"
    return f"{s['median']:.{digits}g} [{s['min']:.{digits}g}, {s['max']:.{digits}g}]"


def make_row(case: str, *, metric: str = "", baseline: dict | None = None, candidate: dict | None = None,
             ratio: dict | None = None, headline: str = "", target: str | None = None,
             meets_target: bool | None = None, details: dict | None = None, status: str = "ok",
             error: str | None = None) -> dict:
    return {"case": case, "status": status, "error": error, "metric": metric, "baseline": baseline,
            "candidate": candidate, "ratio": ratio, "headline": headline, "target": target,
            "meets_target": None if meets_target is None else bool(meets_target), "details": details or {}}


def error_row(case: str, exc: BaseException | str, **kw) -> dict:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return make_row(case, status="error", error=text[-2000:], headline=f"failed: {text.splitlines()[0][:200]}", **kw)


# --------------------------------------------------------------------------- machine and load


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def package_versions(names: Iterable[str] = VERSION_PACKAGES) -> dict[str, str]:
    from sweeps.parent_run import package_versions as installed_versions

    return {"python": platform.python_version(), **installed_versions(tuple(names))}


def git_commit() -> str:
    """Short HEAD of this checkout (``+dirty`` with uncommitted changes), or "unknown"."""
    from sweeps.parent_run import git_commit as full_commit

    head, plus, dirty = full_commit(ROOT).partition("+")
    return (head[:7] if head != "unknown" else head) + plus + dirty


def machine_info() -> dict:
    """CPU model, cores, RAM, versions, date: what a reader needs to weigh the numbers."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    try:
        import torch

        threads = torch.get_num_threads()
        cuda = torch.cuda.is_available()
    except ImportError:
        threads, cuda = None, False
    return {
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "cpus_usable": affinity,
        "ram_gib": _ram_gib(), "platform": platform.platform(), "hostname": platform.node(),
        "torch_threads": threads, "cuda_available": cuda, "versions": package_versions(),
        "git_commit": git_commit(), "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _proc_stat_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all processes), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class CpuMonitor:
    """How busy *other* processes kept the machine while we measured: machine busy CPU time
    (/proc/stat) minus this process tree's (getrusage of self + reaped children), per wall second.
    Processes we started but did not reap (e.g. daemons a Ray driver leaves to init) count as others."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = _proc_stat_busy_s()
        self.own0 = _own_cpu_s()
        self.load0 = os.getloadavg() if hasattr(os, "getloadavg") else None

    def result(self) -> dict:
        wall = time.monotonic() - self.t0
        busy1, own1 = _proc_stat_busy_s(), _own_cpu_s()
        out: dict[str, Any] = {"wall_s": round(wall, 2), "own_cpu_s": round(own1 - self.own0, 2),
                               "loadavg_start": self.load0,
                               "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
        if busy1 is not None and self.busy0 is not None and wall > 0:
            busy = busy1 - self.busy0
            other = max(0.0, busy - (own1 - self.own0))
            out.update(machine_busy_cpu_s=round(busy, 2), other_cpu_s=round(other, 2),
                       other_cores_avg=round(other / wall, 3), cores=os.cpu_count())
        return out


SHARED_THRESHOLD_CORES = 0.2  # other processes using more than this many cores on average = a shared machine


# --------------------------------------------------------------------------- running one benchmark


def new_result(name: str, title: str, ctx: Context) -> dict:
    return {"schema": SCHEMA_VERSION, "name": name, "title": title, "mode": "quick" if ctx.quick else "full",
            "status": "ok", "error": None, "started_at": None, "wall_s": None, "machine": None, "load": None,
            "target": "", "summary": "", "rows": [], "notes": [], "details": {}}


def execute(name: str, title: str, run: Callable[[Context], dict], ctx: Context) -> dict:
    """Run one benchmark and return its result; never raises (an exception becomes status "error")."""
    result = new_result(name, title, ctx)
    result["started_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    result["machine"] = machine_info()
    monitor = CpuMonitor()
    t0 = time.perf_counter()
    try:
        produced = run(ctx)
        result.update({k: v for k, v in produced.items() if k not in ("name", "schema", "mode")})
        if ctx.cut:
            result["notes"] = list(result.get("notes", [])) + [f"Time budget: {c}." for c in ctx.cut]
        if any(r.get("status") == "error" for r in result["rows"]) and result["status"] == "ok":
            result["status"] = "partial"
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it never takes the suite down
        result.update(status="error", error=traceback.format_exc()[-4000:],
                      summary=f"{title}: failed "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result["load"] = monitor.result()
    return result


def interim_result(name: str, title: str, ctx: Context, rows: list[dict]) -> dict:
    """What a benchmark has measured so far, saved while it runs (``Context.keep``). Replaced by
    the final result; left in place (status "partial") if the process is stopped before that."""
    result = new_result(name, title, ctx)
    result.update(status="partial", machine=machine_info(), rows=rows,
                  started_at=_dt.datetime.fromtimestamp(time.time() - (time.monotonic() - ctx.t_start),
                                                        _dt.UTC).isoformat(timespec="seconds"),
                  error="stopped before it finished; the rows it had measured are kept",
                  summary=f"{title}: stopped before it finished; measured: "
                          + "; ".join(f"{r['case']}: {r.get('headline', '')}" for r in rows),
                  notes=[f"Time budget: {c}." for c in ctx.cut])
    return result


def write_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=_json_default, allow_nan=True) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def bench_main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks NAME [--quick] [--repeats N] [--out PATH]``: run the benchmark in
    ``benchmarks/bench_NAME.py`` (its ``NAME``, ``TITLE`` and ``run(ctx)``) alone; always exit 0
    once a result file is written (a benchmark reports, it never fails)."""
    import importlib

    p = argparse.ArgumentParser(prog="python -m benchmarks", description="run one benchmark alone")
    p.add_argument("name", help="the benchmark: benchmarks/bench_NAME.py (e.g. tracking_overhead)")
    p.add_argument("--module", default=None, help="import the benchmark from this module instead (tests)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (checks the code path)")
    p.add_argument("--repeats", type=int, default=None, help="override the number of measured repeats")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/NAME.json)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temp folder)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="soft time budget in seconds: optional repeats are dropped to stay within it")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=JSON",
                   help="benchmark option, e.g. --opt 'cases=[\"digits_cnn\"]' (repeatable)")
    a = p.parse_args(argv)
    try:
        module = importlib.import_module(a.module or f"benchmarks.bench_{a.name}")
    except ModuleNotFoundError:
        p.error(f"no benchmark {a.name!r}: benchmarks are " + ", ".join(
            sorted(f.stem.removeprefix("bench_") for f in Path(__file__).parent.glob("bench_*.py"))))
    name, title, run = module.NAME, module.TITLE, module.run
    options = {}
    for item in a.opt:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    out = a.out or (RESULTS_DIR / f"{name}.json")
    with tempfile.TemporaryDirectory(prefix=f"sweeps-bench-{name}-", dir=a.workdir) as tmp:
        ctx = Context(quick=a.quick, repeats=a.repeats, workdir=Path(tmp), options=options, budget_s=a.budget_s)
        ctx.on_rows = lambda rows: write_result(interim_result(name, title, ctx, rows), out)
        try:
            result = execute(name, title, run, ctx)
        finally:
            for close in reversed(ctx.closers):
                close()
    write_result(result, out)
    print(f"{name}: {result['status']}: {result.get('summary', '')}\nwrote {out}", flush=True)
    return 0
