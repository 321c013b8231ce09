"""Third-party private APIs only behind their named adapter modules: no other module of core/,
sweeps/ or dashboards/ imports a private module or name of MLflow, Ray or Optuna, nor reaches a
private attribute through one of their modules. The adapters were read against the installed
versions. Static: nothing here imports the libraries. (Optuna's adapter test also follows private
names onto Optuna's objects: tests/sweeps/backends/test_optuna_adapter.py.)"""
from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("core", "sweeps", "dashboards")
ADAPTERS = {"mlflow": ROOT / "sweeps" / "tracking" / "mlflow_adapter.py",
            "ray": ROOT / "sweeps" / "backends" / "ray_adapter.py",
            "optuna": ROOT / "sweeps" / "backends" / "optuna_adapter.py"}
CHECKED = {"mlflow": "MLFLOW_CHECKED", "ray": "RAY_CHECKED", "optuna": "OPTUNA_CHECKED"}
DYNAMIC_IMPORTS = ("importlib.import_module", "import_module", "__import__")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _bound_modules(tree: ast.AST, library: str) -> set[str]:
    """Names a module binds to the library or one of its modules (``import mlflow.pytorch``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == library}
    return names


def private_uses(path: Path, library: str) -> list[str]:
    """``file:line: what`` for each use of ``library``'s private API in the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bound = _bound_modules(tree, library)
    found = []

    def say(node: ast.AST, what: str) -> None:
        found.append(f"{path.name}:{node.lineno}: {what}")

    def private_module(name: str) -> bool:
        parts = name.split(".")
        return parts[0] == library and any(map(_private, parts[1:]))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if private_module(alias.name):
                    say(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == library:
            if private_module(node.module or "") or any(_private(a.name) for a in node.names):
                say(node, f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in DYNAMIC_IMPORTS and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and private_module(node.args[0].value)):
            say(node, ast.unparse(node))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                say(node, ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[0], ast.Name) and node.args[0].id in bound
              and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))):
            say(node, ast.unparse(node))
    return found


@pytest.mark.parametrize("library", sorted(ADAPTERS))
def test_only_the_adapter_uses_the_librarys_private_api(library):
    adapter = ADAPTERS[library]
    found = [hit for package in SCANNED for path in sorted((ROOT / package).rglob("*.py")) if path != adapter
             for hit in private_uses(path, library)]
    assert not found, (f"{library}'s private API used outside {adapter.relative_to(ROOT)} (add a named function "
                       "there saying why the public API does not do it, and call that):\n" + "\n".join(found))
    assert private_uses(adapter, library)  # the scan sees the adapter's own uses


@pytest.mark.parametrize("library", sorted(ADAPTERS))
def test_each_adapter_was_read_against_the_installed_library(library):
    source = ADAPTERS[library].read_text(encoding="utf-8")
    checked = next(n.value.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assign)
                   and [ast.unparse(t) for t in n.targets] == [CHECKED[library]] and isinstance(n.value, ast.Constant))
    installed = importlib.metadata.version(library)
    assert installed == checked, (
        f"{library} {installed} is installed but {ADAPTERS[library].relative_to(ROOT)} was read against {checked}. "
        f"Private names change without notice: re-check each function of the adapter against this {library}'s "
        f"source, then set {CHECKED[library]}.")


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib\n"
        "import mlflow.tracking\n"
        "from mlflow.tracking._tracking_service.utils import get_tracking_uri\n"  # 3: a private module
        "from mlflow.tracking import _use_it\n"  # 4: a private name
        "import ray.train._internal.session\n"  # 5: ray, not mlflow
        "x = mlflow.tracking._tracking_service\n"  # 6: an attribute through the module
        "def f(client):\n"
        "    importlib.import_module('mlflow.store._private')\n"  # 8
        "    getattr(mlflow, '_hidden')\n"  # 9
        "    return client._own_thing, mlflow.tracking.MlflowClient\n",  # ours to judge, public
        encoding="utf-8")
    assert sorted(int(hit.split(":")[1]) for hit in private_uses(probe, "mlflow")) == [3, 4, 6, 8, 9]
    assert [int(hit.split(":")[1]) for hit in private_uses(probe, "ray")] == [5]
