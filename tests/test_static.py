"""Static checks ruff can make without running anything: no name is used that is never
defined (a NameError waiting on a path the other tests may not take, such as a benchmark's
full mode), and no module imports what it never uses, except imports made for their side
effect (loading a module ahead of time, registering tasks), which say so with
``# noqa: F401``. `make lint` runs ruff with all the rules of pyproject.toml (and mypy);
these two stay in the test suite as well."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "sweeps", "dashboards", "benchmarks", "tests")


def _ruff(rule: str) -> list[str]:
    """ruff's findings of one rule (and any syntax error) in the packages, one line each."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "--no-cache", "--output-format",
                          "concise", "--select", rule, *PACKAGES], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode in (0, 1), f"ruff failed (exit {out.returncode}): {out.stderr}"
    return out.stdout.splitlines()


def test_no_undefined_names():
    bad = _ruff("F821")
    assert not bad, "\n".join(bad)


def test_no_unused_imports_except_those_marked_for_their_side_effect():
    bad = _ruff("F401")
    assert not bad, "\n".join(bad)


def test_no_module_probes_a_tracker_for_what_it_is():
    """Callers use the Tracker protocol (sweeps/tracking/base.py): no getattr, hasattr or isinstance
    on a tracker to find out what it is or what it wraps."""
    import ast

    probes = []
    for package in ("core", "sweeps", "dashboards"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr", "isinstance") and node.args
                        and "tracker" in ast.unparse(node.args[0]).lower()):
                    probes.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, probes
