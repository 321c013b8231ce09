"""A local MLflow store that was moved (or copied) with its ``runs/`` folder keeps working.

MLflow records absolute artifact locations in its SQLite database: every experiment's
``artifact_location`` (``/old/place/runs/mlartifacts/<experiment>``), every run's
``artifact_uri``, every logged model's and model version's. After ``mv project elsewhere``
MLflow reads from, and writes into, the old absolute path: a checkpoint that is there reads
as missing, and a new artifact recreates the old folder (a copy would write into the
original's). ``sweeps`` keeps artifacts beside the database (``runs/mlartifacts``, see
``parent_run.tracker_for``), so a store whose recorded folder is another ``mlartifacts`` while
its own sibling ``mlartifacts/<experiment>`` exists has moved: :func:`follow_moved_store`
points those locations at the sibling folder, in one transaction, and says so. It is called
by the commands that read or write a store's artifacts (``report``, ``rerun``, ``promote``),
never by a dry run. When the recorded folder is missing and the store has no ``mlartifacts``
folder beside it, the artifacts are gone (the database was moved alone): a clear error naming both.
"""
from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from sweeps.errors import PathError

ARTIFACTS = "mlartifacts"
_FILE = "file://"
# Every column MLflow 3 keeps an absolute artifact location in: (table, column).
_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
            ("logged_models", "artifact_location"), ("model_versions", "storage_location"),
            ("model_versions", "source"))


def _local(location: str) -> Path | None:
    """The folder an artifact location names, when it is a local absolute path."""
    text = location[len(_FILE):] if location.startswith(_FILE) else location
    return Path(text) if text.startswith("/") and "://" not in text else None


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def moved_roots(db: Path) -> tuple[dict[str, str], list[str]]:
    """``({old mlartifacts folder: this store's}, [problems])`` for the store file ``db``: the
    recorded artifact roots to repoint, and each experiment whose artifacts are nowhere.

    A recorded root that still exists while the store has no folder of that experiment beside
    it (the database alone was copied) is left alone: the artifacts are read where they are."""
    here = db.parent / ARTIFACTS
    moves: dict[str, str] = {}
    problems: list[str] = []
    with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
        rows = con.execute("SELECT name, artifact_location FROM experiments WHERE lifecycle_stage != 'deleted'")
        for name, location in rows.fetchall():
            recorded = _local(location or "")
            if recorded is None or recorded.parent.name != ARTIFACTS or _same_folder(recorded.parent, here):
                continue  # a server's store, MLflow's own ./mlruns default, or already in place
            if (here / recorded.name).is_dir() or (here.is_dir() and not recorded.exists()):
                # Beside the store, or nowhere (an experiment that never logged a file): from
                # now on its artifacts are beside the store, never in the folder it came from.
                moves[str(recorded.parent)] = str(here.resolve())
            elif not recorded.exists():
                problems.append(f"experiment {name!r}: its artifacts were recorded at {recorded}, which does not "
                                f"exist, and there is no {ARTIFACTS} folder beside the store ({here})")
    return moves, problems


def follow_moved_store(uri: str, console=None) -> int:
    """Repoint the artifact locations of the local SQLite store at ``uri`` that still name the
    folder it was moved from (see the module's docstring); returns how many rows changed.
    PathError (exit 2) when an experiment's recorded folder is missing and the store has no
    ``mlartifacts`` folder beside it. A store that is not a local SQLite file is left alone."""
    if not uri.startswith("sqlite:///"):
        return 0
    db = Path(uri[len("sqlite:///"):])
    if not db.is_file():
        return 0  # the command's own check names a missing store
    try:
        moves, problems = moved_roots(db)
    except sqlite3.DatabaseError:
        return 0  # a damaged store: the command's own open of it names the file and the fix
    if problems:
        raise PathError(f"MLflow store {db}: " + "; ".join(problems) + ". Put the mlartifacts folder back beside "
                        f"the store ({db.parent / ARTIFACTS}), or run the command where the study ran")
    if not moves:
        return 0
    changed = 0
    with contextlib.closing(sqlite3.connect(db)) as con, con:  # one transaction: all move, or none
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table, column in _COLUMNS:
            if table not in tables or column not in {r[1] for r in con.execute(f"PRAGMA table_info({table})")}:
                continue  # another MLflow schema: nothing of that kind to repoint
            for old, new in moves.items():
                for prefix in ("", _FILE):
                    changed += con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                        f"WHERE substr({column}, 1, ?) = ?",
                        (prefix + new, len(prefix + old) + 1, len(prefix + old) + 1, prefix + old + "/")).rowcount
    if console is not None:
        for old, new in moves.items():
            console.print(f"note: {db} was moved: its artifact locations named {old}; they name {new} now "
                          f"({changed} records updated)", markup=False, highlight=False)
    return changed
