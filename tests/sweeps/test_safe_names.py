"""sweeps.safe_names: names and paths that would escape their folder are refused."""
from __future__ import annotations

import os

import pytest

from sweeps.errors import UnsafeNameError
from sweeps.safe_names import safe_component, safe_relpath, safe_subpath

BAD_ANYWHERE = [
    ("..", "'..'"),
    ("", "empty"),
    ("a\\b", "backslash"),
    ("a\x00b", "NUL"),
    ("a\nb", "control"),
    ("a\x7fb", "control"),
    ("%2e%2e", "percent-encoded"),
    ("%2E%2E", "percent-encoded"),
    ("a%2fb", "percent-encoded"),
    ("a%5Cb", "percent-encoded"),
    ("%252e%252e", "percent-encoded"),  # double-encoded
    ("%25252f", "percent-encoded"),  # triple-encoded
    ("%%32e%%32e", "decodes"),  # an encoding the pattern does not spell out
]


@pytest.mark.parametrize("value,reason", BAD_ANYWHERE + [("a/b", "'/'"), ("/abs", "'/'"), ("C:x", "drive")])
def test_safe_component_refuses(value, reason):
    with pytest.raises(UnsafeNameError) as err:
        safe_component(value, "study name")
    msg = str(err.value)
    assert "study name" in msg and repr(value) in msg and reason in msg
    assert "Allowed:" in msg  # says what would be accepted


@pytest.mark.parametrize("value", ["lr_bs", "study-1", "v1.2", "a b", "a..b", "x%20y", "mlflow:tag", "ünï"])
def test_safe_component_accepts(value):
    assert safe_component(value, "name") == value


@pytest.mark.parametrize(
    "value",
    [v for v, _ in BAD_ANYWHERE]
    + ["../x", "/abs", "a/../b", "a/./b", "a//b", "%2e%2e/x", "x/%2e%2e", "C:/x", "/", "./x"],
)
def test_safe_subpath_refuses(value):
    with pytest.raises(UnsafeNameError) as err:
        safe_subpath(value, "artifact path")
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(
    "value,expected",
    [("checkpoints", "checkpoints"), ("config/resolved_config.json", "config/resolved_config.json"),
     ("onnx/", "onnx"), ("a..b/c", "a..b/c")],
)
def test_safe_subpath_accepts(value, expected):
    assert safe_subpath(value, "artifact path") == expected


def test_safe_subpath_refuses_non_strings():
    with pytest.raises(UnsafeNameError, match="not a string"):
        safe_subpath(None, "artifact path")  # type: ignore[arg-type]


def test_safe_relpath_stays_inside_root(tmp_path):
    (tmp_path / "runs" / "study").mkdir(parents=True)
    root = tmp_path / "runs"
    assert safe_relpath("study/trial_0", root) == (root / "study" / "trial_0").resolve()
    for bad in ["../x", "/etc/passwd", "%2e%2e/x", "a\\b", "a\x00b", "study/../../x", ""]:
        with pytest.raises(UnsafeNameError):
            safe_relpath(bad, root)


def test_safe_relpath_refuses_a_symlink_that_leaves_root(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")
    with pytest.raises(UnsafeNameError, match="outside"):
        safe_relpath("link/x", root)
