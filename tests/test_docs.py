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
