"""core.diskfull: a full disk recognised in whatever form it surfaced, described in one line."""
from __future__ import annotations

import errno
import shutil
import sqlite3

from core.diskfull import describe_disk_full, is_disk_full

# torch.save's messages on a full disk (torch 2.x, caught from a real save on a full tmpfs).
TORCH_UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
TORCH_WRITE_FAILED = "PytorchStreamWriter failed writing file data/0: file write failed"


def _free_mb(path) -> str:
    mb = shutil.disk_usage(path).free / 1e6
    return f"{mb:.1f}" if mb < 10 else f"{mb:.0f}"


def test_a_real_enospc_oserror_names_the_path_and_its_free_space(tmp_path):
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "last.pt"))
    assert describe_disk_full(exc, tmp_path) == f"disk full: {tmp_path} has {_free_mb(tmp_path)} MB free"


def test_torch_unexpected_pos_and_file_write_failed_mean_a_full_disk(tmp_path):
    for text in (TORCH_UNEXPECTED_POS, TORCH_WRITE_FAILED):
        assert describe_disk_full(RuntimeError(text), tmp_path).startswith(f"disk full: {tmp_path} has ")


def test_enospc_found_anywhere_in_the_exception_chain(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("checkpoint write failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
        assert describe_disk_full(outer, tmp_path).startswith("disk full:")


def test_sqlite_database_or_disk_is_full_is_recognised(tmp_path):
    assert describe_disk_full(sqlite3.OperationalError("database or disk is full"), tmp_path) is not None


def test_other_errors_are_not_a_full_disk(tmp_path):
    assert describe_disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path) is None
    assert describe_disk_full(RuntimeError("CUDA out of memory"), tmp_path) is None
    assert describe_disk_full(None, tmp_path) is None


def test_a_path_that_does_not_exist_yet_reports_its_nearest_existing_folder(tmp_path):
    path = tmp_path / "not" / "yet" / "best.pt"
    exc = OSError(errno.ENOSPC, "No space left on device")
    assert describe_disk_full(exc, path) == f"disk full: {path} has {_free_mb(tmp_path)} MB free"


def test_without_a_path_the_oserror_filename_is_named(tmp_path):
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.journal"))
    assert describe_disk_full(exc, None).startswith(f"disk full: {tmp_path / 'x.journal'} has ")
