"""Names that reach the file system or the artifact store cannot escape the runs folder."""
from __future__ import annotations

import pytest

from tests.sweeps.study_helpers import cli_in_process, write_spec

BAD = ["../escape", "/abs/path", "%2e%2e/x", "%252e%252e", "a\\b", "a\x00b", "runs/../../x"]


@pytest.mark.parametrize("bad", BAD)
def test_bad_study_names_and_storage_paths_are_refused_before_anything_is_written(tmp_path, bad):
    work = tmp_path / "work"
    work.mkdir()
    spec = write_spec(work, name="ok", seed_store=False, storage=f"runs/{bad}.journal")
    text = spec.read_text().replace("name: ok", f"name: {bad!r}" if "\x00" not in bad else 'name: "a\\0b"')
    spec.write_text(text)
    proc = cli_in_process(work, "run", str(spec))  # refused before a study starts
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "- name:" in proc.stderr
    if bad != "/abs/path":  # runs//abs/path.journal is a plain path inside runs/, so only the name is bad
        assert "- storage:" in proc.stderr
    assert sorted(p.name for p in work.iterdir()) == ["ok.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


# A NUL byte cannot reach argv at all (the OS refuses it); safe_component refuses it for API
# callers (tests/sweeps/test_safe_names.py).
@pytest.mark.parametrize("bad", [b for b in BAD if "\x00" not in b])
def test_bad_model_names_are_refused_by_promote(tmp_path, bad):
    work = tmp_path / "work"
    work.mkdir()
    spec = write_spec(work, name="ok", seed_store=False)
    proc = cli_in_process(work, "promote", str(spec), "--model-name", bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "model" in proc.stderr.lower()
    assert sorted(p.name for p in work.iterdir()) == ["ok.yaml"]
