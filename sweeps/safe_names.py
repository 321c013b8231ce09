"""Refuse names that would escape their folder when they reach a file system or an
artifact store.

A study name becomes a folder under ``runs/``, an experiment's artifact location, a
trial's artifact path; any of those coming from a spec, a CLI argument or a tag must not
be able to climb out (``..``), jump elsewhere (``/abs``, ``C:\\x``), or smuggle those in
encoded form (``%2e%2e``, ``%252f``). Every check raises
:class:`sweeps.errors.UnsafeNameError` naming the value and what is allowed.
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

from sweeps.errors import UnsafeNameError

# "%2e" = ".", "%2f" = "/", "%5c" = "\"; "%25" is "%" itself, so "%252e" is a
# double-encoded dot that a second decoding layer (a proxy, a URL join) would turn into ".".
_ENCODED_SEPARATOR = re.compile(r"%(?:25)*(?:2e|2f|5c)", re.IGNORECASE)
_DRIVE = re.compile(r"^[A-Za-z]:")
_ALLOWED = (
    "a relative name without '..' components, a leading '/', a drive letter, backslashes, "
    "percent-encoded '.', '/' or '\\' (%2e, %2f, %5c, also double-encoded), NUL or other "
    "control characters"
)


def _refuse(what: str, value: object, reason: str) -> UnsafeNameError:
    return UnsafeNameError(f"{what} {value!r} is refused: {reason}. Allowed: {_ALLOWED}.")


def _check_characters(value: str, what: str) -> None:
    """The checks shared by a single component and a multi-component path."""
    if "\x00" in value:
        raise _refuse(what, value, "it contains a NUL byte")
    for ch in value:
        # Cc covers C0 (\x00-\x1f), DEL and C1 controls: none belong in a file name.
        if unicodedata.category(ch) == "Cc":
            raise _refuse(what, value, f"it contains the control character {ch!r}")
    if "\\" in value:
        raise _refuse(what, value, "it contains a backslash")
    if _ENCODED_SEPARATOR.search(value):
        raise _refuse(what, value, "it contains a percent-encoded '.', '/' or '\\'")
    # Belt and braces for encodings the pattern does not spell out (e.g. "%%32e"):
    # decode a few layers and look for what decoding must never produce.
    decoded = value
    for _ in range(3):
        nxt = unquote(decoded)
        if nxt == decoded:
            break
        decoded = nxt
        new_slash = decoded.count("/") > value.count("/")
        dotdot = ".." in re.split(r"[/\\]", decoded)
        encoded_again = _ENCODED_SEPARATOR.search(decoded) is not None
        if new_slash or dotdot or encoded_again or "\\" in decoded or "\x00" in decoded:
            raise _refuse(what, value, "it decodes (%-encoding) to a path separator or '..'")


def safe_component(name: str, what: str = "name") -> str:
    """Return ``name`` unchanged if it is one safe path component, else raise.

    Used for single names that become one folder or file: a study name, a trial folder,
    an experiment's artifact folder. ``what`` says what the value is in the message
    ("study name", "artifact file").
    """
    if not isinstance(name, str):
        raise _refuse(what, name, f"it is a {type(name).__name__}, not a string")
    _check_characters(name, what)
    if "/" in name:
        raise _refuse(what, name, "it contains '/' (one name is expected, not a path)")
    _check_component(name, name, what)
    return name


def _check_component(part: str, whole: str, what: str) -> None:
    """Checks on one '/'-free component; the message names the whole value."""
    if part.strip() == "":
        raise _refuse(what, whole, "it is empty" if part == whole else "it has an empty component")
    if part in (".", ".."):
        raise _refuse(what, whole, f"it has a '{part}' component" if part != whole else f"'{part}' is not a name")
    if _DRIVE.match(part):
        raise _refuse(what, whole, "it starts with a drive letter")


def safe_subpath(path: str, what: str = "path") -> str:
    """Return ``path`` as a normalised relative POSIX path if every component is safe.

    Used for paths inside an artifact store (``checkpoints``, ``config/resolved.json``),
    which have no local root to resolve against. One trailing '/' is tolerated;
    empty components ('a//b') are refused because stores disagree on what they mean.
    """
    if not isinstance(path, str):
        raise _refuse(what, path, f"it is a {type(path).__name__}, not a string")
    if path.startswith("/"):
        raise _refuse(what, path, "it is an absolute path")
    _check_characters(path, what)
    trimmed = path[:-1] if path.endswith("/") else path
    if trimmed == "":
        raise _refuse(what, path, "it is empty")
    parts = trimmed.split("/")
    for part in parts:
        _check_component(part, path, what)
    return str(PurePosixPath(*parts))


def safe_relpath(path: str | Path, root: str | Path, what: str = "path") -> Path:
    """Return ``root / path`` resolved, if it is a safe relative path that stays inside
    ``root`` after resolving symlinks; raise otherwise.

    Used before reading or writing a local file named by user input (a trial folder
    under ``runs/``, a file named in a spec).
    """
    text = str(path) if isinstance(path, Path) else path
    if not isinstance(text, str):
        raise _refuse(what, path, f"it is a {type(path).__name__}, not a string")
    if text.startswith("/") or _DRIVE.match(text):
        raise _refuse(what, path, "it is an absolute path")
    rel = safe_subpath(text, what)
    root_resolved = Path(root).resolve()
    target = (root_resolved / rel).resolve()
    # resolve() follows symlinks: a link inside root pointing outside is caught here.
    if target != root_resolved and not target.is_relative_to(root_resolved):
        raise _refuse(what, path, f"it resolves to {str(target)!r}, outside {str(root_resolved)!r}")
    return target
