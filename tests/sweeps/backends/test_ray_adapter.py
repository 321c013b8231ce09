"""Ray's private API (``ray.<...>._name`` modules) is used only in sweeps/backends/ray_adapter.py,
and the adapter was read against the installed Ray. Static: nothing here imports Ray."""
from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

from sweeps.backends import ray_adapter

ROOT = Path(__file__).resolve().parents[3]
ADAPTER = ROOT / "sweeps" / "backends" / "ray_adapter.py"
SCANNED = ("core", "sweeps", "dashboards")


def test_the_adapter_was_read_against_the_installed_ray():
    installed = importlib.metadata.version("ray")
    assert installed == ray_adapter.RAY_CHECKED, (
        f"Ray {installed} is installed but sweeps/backends/ray_adapter.py was read against "
        f"{ray_adapter.RAY_CHECKED}. Private names change without notice: re-check each function of the "
        "adapter against this Ray's source, then set RAY_CHECKED.")


def _private_ray_modules(path: Path) -> list[str]:
    """``file:line: module`` for each import of a Ray module with a private part in its path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                    "__import__"):
            names = [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        for name in names:
            parts = name.split(".")
            if parts[0] == "ray" and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{path.relative_to(path.parents[len(path.parents) - 1])}:{node.lineno}: {name}")
    return found


def test_only_the_adapter_imports_rays_private_modules():
    found = [hit for package in SCANNED for path in sorted((ROOT / package).rglob("*.py")) if path != ADAPTER
             for hit in _private_ray_modules(path)]
    assert not found, ("Ray's private API used outside sweeps/backends/ray_adapter.py (add a named function "
                       "there saying why the public API does not do it, and call that):\n" + "\n".join(found))
    assert _private_ray_modules(ADAPTER)  # the scan sees the adapter's own uses


def test_the_scan_finds_each_kind_of_private_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\nimport ray.train._internal.session\nfrom ray.tune import Checkpoint\n"
                     "from ray._private import worker\nfrom ray.train._internal.session import get_session\n"
                     "def f():\n    importlib.import_module('ray.air._internal.util')\n", encoding="utf-8")
    assert [int(hit.split(":")[1]) for hit in _private_ray_modules(probe)] == [2, 4, 5, 7]
