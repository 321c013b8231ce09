"""What MLflow accepts as keys and values: the tracker cleans every param, tag and metric
name here (with a warning) rather than have the store refuse a whole batch for one of them."""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

MAX_PARAM_VAL_LENGTH = 6000  # mlflow.utils.validation
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def sanitize_key(key: object) -> str:
    """A key MLflow accepts for a param, metric or tag: only letters, digits and
    ``_ - . : / space``; no empty, '.' or '..' components; at most 250 characters."""
    text = _BAD_KEY_CHARS.sub("_", str(key))
    parts = ["__" if p == ".." else p for p in text.split("/") if p not in ("", ".")]
    return ("/".join(parts) or "_")[:MAX_KEY_LENGTH]


def clean_key(key: object, what: str) -> str:
    """``sanitize_key``, warning when it changed the name (``what``: param, metric, tag)."""
    clean = sanitize_key(key)
    if clean != key:
        log.warning("%s name %r is not valid in MLflow; logged as %r", what, key, clean)
    return clean


def truncate(value: object, limit: int, key: str, what: str) -> str:
    """Stringify; cut to ``limit`` characters ending in a note that says so."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    note = f"...[truncated: {len(text)} chars in full]"
    log.warning("%s %r is %d characters; MLflow keeps %d, so it was truncated", what, key, len(text), limit)
    return text[: limit - len(note)] + note


def param_values(params: Mapping[Any, Any]) -> dict[str, str]:
    """Params as the store takes them: clean keys, stringified and truncated values."""
    out = {}
    for key, value in params.items():
        k = clean_key(key, "param")
        out[k] = truncate(value, MAX_PARAM_VAL_LENGTH, k, "param")
    return out


def tag_values(tags: Mapping[Any, Any]) -> dict[str, str | None]:
    """Tags as the store takes them; None (the tag is to be removed) stays None."""
    out: dict[str, str | None] = {}
    for key, value in tags.items():
        k = clean_key(key, "tag")
        out[k] = None if value is None else truncate(value, MAX_TAG_VAL_LENGTH, k, "tag")
    return out
