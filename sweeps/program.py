"""How a user runs this program again: the command the printed next steps start with.

``make run`` starts ``.venv/bin/sweeps``, which is not on PATH, so a printed ``sweeps status ...``
would answer "command not found". The steps start with ``sweeps`` only when PATH finds this same
program; otherwise with the path that runs it (relative to the working folder when under it).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def _running_script() -> Path | None:
    """The ``sweeps`` console script this process runs (or, in-process, the one beside Python)."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if started is not None and started.name == "sweeps" and started.is_file():
        return started
    beside = Path(sys.executable).parent / "sweeps"
    return beside if beside.is_file() else None


def _shown(path: Path) -> str:
    absolute = path.absolute()
    try:
        relative = absolute.relative_to(Path.cwd())
    except ValueError:
        return shlex.quote(str(absolute))
    return shlex.quote(str(relative) if relative.parent != Path(".") else f"./{relative}")


def sweeps_command() -> str:
    """``sweeps`` when PATH runs this program by that name, else the command that does."""
    script = _running_script()
    on_path = shutil.which("sweeps")
    if script is None or (on_path is not None and os.path.samefile(on_path, script)):
        return "sweeps"
    return _shown(script)
