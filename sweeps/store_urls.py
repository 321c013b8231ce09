"""What a store's URL says without opening it: which SQL database it names, the SQLite file it
points at, and the URL with its password masked for logs and artifacts.

Both the spec (validating ``storage:`` and ``tracking.uri``) and the tracking package (the spool's
store key, the store checks) read URLs this way, so it imports nothing of either."""
from __future__ import annotations

import re
from pathlib import Path

RDB_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")  # SQLAlchemy URL schemes


def redact_url(url: str) -> str:
    """``scheme://user:secret@host`` -> ``scheme://user:***@host`` (for logs and artifacts)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*):[^@/]*@", r"\1:***@", url)


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` URI (``sqlite:////abs`` is absolute); None for others and memory."""
    if not uri.startswith("sqlite:///"):
        return None
    rest = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(rest) if rest and rest != ":memory:" else None
