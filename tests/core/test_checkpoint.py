"""Checkpoints: atomic writes (a kill mid-write included), weights_only loading, prefixes, fall-back
to the previous file."""
from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core import checkpoint as ckpt

ROOT = str(Path(__file__).resolve().parents[2])


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the marker file proves code ran


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": _Payload(str(marker))}, evil)
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointError, match="evil.pt.*refused"):
        ckpt.load_checkpoint(evil)
    assert not marker.exists()


def test_raw_pickle_file_is_refused(tmp_path):
    marker = tmp_path / "pwned2"
    evil = tmp_path / "raw.pt"
    evil.write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ckpt.CheckpointError, match="raw.pt"):
        ckpt.load_checkpoint(evil)
    assert not marker.exists()


def test_prefixes_are_stripped():
    sd = {"module._orig_mod.fc.weight": torch.ones(1), "_orig_mod.module.b": torch.zeros(1), "c": torch.ones(2)}
    assert set(ckpt.strip_prefixes(sd)) == {"fc.weight", "b", "c"}


def test_truncated_last_falls_back_to_previous(tmp_path):
    ckpt.save_last({"epoch": 1, "w": torch.ones(3)}, tmp_path)
    ckpt.save_last({"epoch": 2, "w": torch.ones(3) * 2}, tmp_path)
    data = (tmp_path / ckpt.LAST).read_bytes()
    (tmp_path / ckpt.LAST).write_bytes(data[: len(data) // 2])
    with pytest.warns(RuntimeWarning, match="last.pt is corrupt"):
        state, path = ckpt.load_resume_state(tmp_path)
    assert path.name == ckpt.PREV and state["epoch"] == 1


def test_all_checkpoints_unreadable_is_an_error_not_a_restart(tmp_path):
    (tmp_path / ckpt.LAST).write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning), pytest.raises(ckpt.CheckpointError, match="no readable checkpoint"):
        ckpt.load_resume_state(tmp_path)


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert ckpt.load_resume_state(tmp_path) is None


def test_disk_full_keeps_previous_checkpoint_and_no_temp_files(tmp_path, monkeypatch):
    ckpt.save_last({"epoch": 1}, tmp_path)
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        ckpt.save_last({"epoch": 2}, tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    assert ckpt.load_checkpoint(tmp_path / ckpt.LAST)["epoch"] == 1
    assert sorted(os.listdir(tmp_path)) == [ckpt.LAST]


_SAVE_EPOCH_2 = "import sys, torch; from core import checkpoint as c; " \
                "c.save_last({'epoch': 2, 'w': torch.full((1000,), 2.0)}, sys.argv[1])"


@pytest.mark.slow
def test_a_kill_mid_checkpoint_leaves_the_previous_last_pt_intact_and_loadable(tmp_path):
    ckpt.save_last({"epoch": 1, "w": torch.ones(1000)}, tmp_path)
    before = (tmp_path / ckpt.LAST).read_bytes()
    env = {**os.environ, "PYTHONPATH": ROOT, "SWEEPS_FAULT": "mid_checkpoint"}
    proc = subprocess.run([sys.executable, "-c", _SAVE_EPOCH_2, str(tmp_path)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL  # it died at the fault point, not before
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the new file was being written

    assert (tmp_path / ckpt.LAST).read_bytes() == before
    state, path = ckpt.load_resume_state(tmp_path)
    assert path.name == ckpt.LAST and state["epoch"] == 1 and torch.equal(state["w"], torch.ones(1000))
    # Without the switch, the same write goes through.
    env.pop("SWEEPS_FAULT")
    subprocess.run([sys.executable, "-c", _SAVE_EPOCH_2, str(tmp_path)], env=env, timeout=120, check=True)
    assert ckpt.load_checkpoint(tmp_path / ckpt.LAST)["epoch"] == 2


def test_best_is_the_last_checkpoint_linked_and_keeps_its_epoch_after_later_saves(tmp_path):
    first = {"epoch": 1, "w": torch.ones(3)}
    last = ckpt.save_last(first, tmp_path, best=first)
    assert os.stat(tmp_path / ckpt.BEST).st_ino == os.stat(last).st_ino  # no second serialisation
    ckpt.save_last({"epoch": 2, "w": torch.zeros(3)}, tmp_path)  # last.pt replaced, last.prev.pt rotated
    ckpt.save_last({"epoch": 3, "w": torch.zeros(3)}, tmp_path)
    best = ckpt.load_checkpoint(tmp_path / ckpt.BEST)
    assert best["epoch"] == 1 and torch.equal(best["w"], torch.ones(3))
    assert ckpt.load_checkpoint(tmp_path / ckpt.LAST)["epoch"] == 3
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary names left


def test_best_is_written_again_where_the_filesystem_has_no_hard_links(tmp_path, monkeypatch):
    state = {"epoch": 4, "w": torch.ones(2)}

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    last = ckpt.save_last(state, tmp_path, best=state)
    assert os.stat(tmp_path / ckpt.BEST).st_ino != os.stat(last).st_ino
    assert ckpt.load_checkpoint(tmp_path / ckpt.BEST)["epoch"] == 4


def test_rng_states_round_trip_through_a_checkpoint_in_both_forms(tmp_path):
    """The Python RNG's state is saved as one tensor (a list of 625 ints was half a small model's
    checkpoint to pickle); a checkpoint written before, holding the list, restores the same."""
    import random

    import numpy as np

    from core.seeding import rng_state, set_rng_state

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    state = rng_state()
    assert isinstance(state["python"], torch.Tensor) and state["python"].dtype == torch.int64
    ckpt.save_checkpoint({"rng": state}, tmp_path / "s.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    older = {**state, "python": state["python"].tolist()}
    for saved in (torch.load(tmp_path / "s.pt", weights_only=True)["rng"], older):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        set_rng_state(saved)
        assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_a_first_best_save_that_fails_or_is_killed_leaves_no_best_pt_behind(tmp_path, monkeypatch):
    """No earlier best.pt: a save that fails once its best.pt is in place removes it again, and a
    resume with no recorded best (no last.pt, or none with a best yet) removes a killed attempt's
    best.pt, best.prev.pt and temporary files, so a restarted run never reports them as its own."""
    state = {"epoch": 1, "best_epoch": 1, "w": torch.ones(2)}
    real_replace = os.replace

    def no_last(src, dst):
        if os.path.basename(dst) == ckpt.LAST:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", no_last)
    with pytest.raises(OSError, match="No space"):
        ckpt.save_last(state, tmp_path, best=state)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == []

    for name in (ckpt.BEST, ckpt.BEST_PREV, ".last.x1.tmp", f".{ckpt.BEST}.x2.tmp", f".{ckpt.BEST}.7.link"):
        (tmp_path / name).write_bytes(b"from a killed attempt")
    ckpt.settle_best(tmp_path, None)
    assert sorted(os.listdir(tmp_path)) == []
