"""A trial's folder belongs to one trial of one study: it resumes only its own checkpoint.

``runs/<study>/trial-NNNN`` outlives its study: a deleted journal, a spec of the same name
with another storage, a ``--fresh`` version whose folder name is taken. Before a trial trains,
:func:`claimed` takes the folder's lock and reads its ``owner.json``; only a folder written by
this same trial (the study's identity and the folder's trial, with the same parameters) is
kept to resume from. Anything else there is moved aside, with a warning, and never trained
on. A folder whose lock another live process holds (a study of the same name running at the
same time) is never touched: the trial fails with a message saying why.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from core.io_utils import save_json_atomic
from sweeps.errors import StudyStateError

OWNER_FILE, LOCK_FILE = "owner.json", ".owner.lock"
log = logging.getLogger("sweeps")


@contextlib.contextmanager
def claimed(out_dir: Path, owner: str, params: dict) -> Iterator[Path | None]:
    """Hold ``out_dir`` for this trial while the block runs. Yields where a foreign folder's
    files were moved to (None when the folder was absent, empty, or already this trial's)."""
    wanted = {"owner": owner, "params": _canonical(params)}
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            found = _read_owner(out_dir)
            raise StudyStateError(
                f"{out_dir} is in use by another running trial ({found.get('owner', 'owner unknown')}): two "
                "studies of the same name share this folder; give one of them another name, or its storage "
                "another folder") from None
        moved = None
        found = _read_owner(out_dir)
        if found != wanted and any(p.name != LOCK_FILE for p in out_dir.iterdir()):
            moved = _move_aside(out_dir)
            whose = (f"owner {found.get('owner')!r} with params {found.get('params')}" if found
                     else "no owner.json (written by an older version or by hand)")
            log.warning("%s held files of another trial (%s), not of %s with params %s: moved to %s; "
                        "this trial starts from scratch", out_dir, whose, owner, wanted["params"], moved)
        save_json_atomic(wanted, out_dir / OWNER_FILE)
        yield moved


def _canonical(params: dict) -> dict:
    return json.loads(json.dumps(params, sort_keys=True, default=str))


def _read_owner(out_dir: Path) -> dict:
    try:
        found = json.loads((out_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _move_aside(out_dir: Path) -> Path:
    """Move every file but the lock (held here) into ``moved-aside/`` beside the trial folders,
    not among them, so nothing that lists ``trial-*`` finds it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        target = out_dir.parent / "moved-aside" / (f"{out_dir.name}-{stamp}" + (f"-{i}" if i else ""))
        if not target.exists():
            target.mkdir(parents=True)
            for path in out_dir.iterdir():
                if path.name != LOCK_FILE:
                    path.rename(target / path.name)
            return target.resolve()
    raise FileExistsError(f"cannot move {out_dir} aside: too many moved copies next to it")
