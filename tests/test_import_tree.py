"""The product's imports form a tree: no cycle among core, sweeps and dashboards modules.

Imports inside functions count as much as those at the top of a module: a function-level import
placed to dodge a cycle still ties the two modules together. ``TYPE_CHECKING`` blocks are left out
(they are never executed). import-linter (``make lint``) checks the layers and the backends'
independence; this scan checks the cycles, function-level imports included, which it does not."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "sweeps", "dashboards")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (a package's import reaches its __init__)."""
    modules = product_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                # `import a.b.c` runs a, a.b and a.b.c; the packages' __init__ modules count.
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name:
                        graph[name].add(prefix)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def _packages_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between modules, leaving out a module's edge to its own parent packages' __init__."""
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def test_the_scan_finds_a_cycle_through_a_function_level_import():
    source = "import sweeps.b\n"
    other = "def f():\n    import sweeps.a\n"
    graph: dict[str, set[str]] = {"sweeps.a": set(), "sweeps.b": set(), "sweeps.c": set()}
    for name, text in (("sweeps.a", source), ("sweeps.b", other)):
        for node in _imports(ast.parse(text)):
            assert isinstance(node, ast.Import)
            graph[name].update(alias.name for alias in node.names)
    assert cycles(graph) == [["sweeps.a", "sweeps.b"]]


def test_the_scan_leaves_out_type_checking_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sweeps.b\nelse:\n    import x\n")
    assert sorted(alias.name for node in _imports(tree) for alias in node.names) == ["TYPE_CHECKING", "x"]


def test_the_product_modules_import_each_other_without_a_cycle():
    graph = _packages_only(import_graph())
    assert len(graph) > 100  # the scan reads the real tree
    found = cycles(graph)
    assert found == [], "import cycles (function-level imports counted):\n" + "\n".join(
        " <-> ".join(component) for component in found)
