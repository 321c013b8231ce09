"""Static checks pyflakes can make without running anything: no name is used that is never
defined (a NameError waiting on a path the other tests may not take, such as a benchmark's
full mode), and no module imports what it never uses, except imports made for their side
effect (loading a module ahead of time, registering tasks), which say so with ``noqa``."""
from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "sweeps", "dashboards", "benchmarks", "tests")


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list = []

    def flake(self, message) -> None:
        self.found.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")


def _flakes() -> list:
    out = _Collect()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            api.checkPath(str(path), out)
    return out.found


def _marked_noqa(message) -> bool:
    line = Path(message.filename).read_text().splitlines()[message.lineno - 1]
    return "noqa" in line


def test_no_undefined_names():
    bad = [str(m) for m in _flakes() if isinstance(m, str) or isinstance(m, messages.UndefinedName)]
    assert not bad, "\n".join(bad)


def test_no_unused_imports_except_those_marked_for_their_side_effect():
    bad = [str(m) for m in _flakes() if isinstance(m, messages.UnusedImport) and not _marked_noqa(m)]
    assert not bad, "\n".join(bad)
