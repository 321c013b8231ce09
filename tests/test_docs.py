"""The docs name files that exist: "The path of one sweep" in docs/ARCHITECTURE.md names at most
ten files of this repository, each of which exists (a renamed or deleted module must take its
line in the walkthrough with it). Paths under runs/ are what a sweep writes, not files here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.<>-]+)")


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def repo_paths(text: str) -> set[str]:
    """Slash-separated names whose first folder is one of this repository's (runs/..., a sweep's
    output, and URLs are not)."""
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "runs"}
    return {m.rstrip(".") for m in PATH.findall(text) if m.split("/")[0] in top}


def test_the_path_of_one_sweep_names_at_most_ten_files_that_exist():
    text = section((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"), "The path of one sweep")
    named = repo_paths(text)
    assert named, "the section names no file"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
    assert len(named) <= 10, sorted(named)


def test_repo_paths_tells_files_from_a_sweeps_output():
    assert repo_paths("`sweeps/cli.py` writes runs/mlflow.db, see core/train.py.") == {"sweeps/cli.py", "core/train.py"}


# ---- every test a doc names as its proof exists -----------------------------------------------------
TEST_REF = re.compile(r"`([\w./-]*?)(test_\w+\.py)?::(test_\w+)`")


def named_tests(text: str) -> list[tuple[str, str]]:
    """(test file, test function) for each `path/test_x.py::test_y` in ``text``; a bare
    `::test_z` continues the file named last. A file given by its name alone is looked for under tests/."""
    found, current = [], ""
    for folder, name, function in TEST_REF.findall(text):
        if name:
            current = folder + name
        found.append((current, function))
    return found


def _test_file(ref: str) -> Path | None:
    if (ROOT / ref).is_file():
        return ROOT / ref
    matches = [p for p in (ROOT / "tests").rglob(Path(ref).name) if str(p).endswith(ref)]
    return matches[0] if len(matches) == 1 else None


def test_every_test_that_a_reliability_claim_names_exists():
    """docs/RELIABILITY.md proves each row with tests; a renamed or deleted test must take its
    claim with it (or the claim must name the test that proves it now)."""
    text = (ROOT / "docs" / "RELIABILITY.md").read_text(encoding="utf-8")
    refs = named_tests(text)
    assert len(refs) > 30, refs
    missing = []
    for ref, function in refs:
        path = _test_file(ref) if ref else None
        if path is None or not re.search(rf"^\s*(?:async )?def {function}\(", path.read_text(encoding="utf-8"), re.M):
            missing.append(f"{ref}::{function}")
    assert not missing, f"docs/RELIABILITY.md names tests that do not exist: {missing}"


def test_named_tests_reads_paths_and_continuations():
    text = "`tests/a/test_x.py::test_one`, `::test_two`; `test_y.py::test_three`"
    assert named_tests(text) == [("tests/a/test_x.py", "test_one"), ("tests/a/test_x.py", "test_two"),
                                 ("test_y.py", "test_three")]
