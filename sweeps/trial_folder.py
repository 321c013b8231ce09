"""A trial's folder belongs to one trial of one study: it resumes only its own checkpoint.

``runs/<study>/trial-NNNN`` outlives its study: a deleted journal, a spec of the same name
with another storage, a ``--fresh`` version whose folder name is taken. Before a trial trains,
:func:`claim` reads the folder's ``owner.json``; only a folder written by this same trial
(the study's identity and the folder's trial, with the same parameters) is kept to resume
from. Anything else there is moved aside, with a warning, and never trained on.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from core.io_utils import save_json_atomic

OWNER_FILE = "owner.json"
log = logging.getLogger("sweeps")


def claim(out_dir: Path, owner: str, params: dict) -> Path | None:
    """Make ``out_dir`` this trial's before it trains. Returns where a foreign folder was
    moved to (None when the folder was absent, empty, or already this trial's)."""
    wanted = {"owner": owner, "params": _canonical(params)}
    moved = None
    if out_dir.is_dir() and any(out_dir.iterdir()):
        found = _read_owner(out_dir)
        if found != wanted:
            moved = _move_aside(out_dir)
            whose = (f"owner {found.get('owner')!r} with params {found.get('params')}" if found
                     else "no owner.json (written by an older version or by hand)")
            log.warning("%s held files of another trial (%s), not of %s with params %s: moved to %s; "
                        "this trial starts from scratch", out_dir, whose, owner, wanted["params"], moved)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_json_atomic(wanted, out_dir / OWNER_FILE)
    return moved


def _canonical(params: dict) -> dict:
    return json.loads(json.dumps(params, sort_keys=True, default=str))


def _read_owner(out_dir: Path) -> dict:
    try:
        found = json.loads((out_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _move_aside(out_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        # Beside the trial folders, not among them: nothing that lists trial-* finds it.
        target = out_dir.parent / "moved-aside" / (f"{out_dir.name}-{stamp}" + (f"-{i}" if i else ""))
        if not target.exists():
            target.parent.mkdir(exist_ok=True)
            out_dir.rename(target)
            return target
    raise FileExistsError(f"cannot move {out_dir} aside: too many moved copies next to it")
