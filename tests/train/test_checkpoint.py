import os

import pytest
import torch

from vitlab.train import checkpoint as ckpt


def test_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint({"step": step}, tmp_path, step, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-00000003.pt", "ckpt-00000004.pt"]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == 4


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    ckpt.save_checkpoint({"step": 1, "w": torch.arange(10)}, tmp_path, 1, keep=1)
    real_save = torch.save

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint({"step": 2}, tmp_path, 2, keep=1)
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert os.listdir(tmp_path) == ["ckpt-00000001.pt"]  # no temp file, no step-2 name, step 1 kept
    state = ckpt.load_checkpoint(tmp_path / "ckpt-00000001.pt")
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(10))


def test_overwrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "x.pt"
    ckpt.save_atomic({"v": 1}, path)
    monkeypatch.setattr(ckpt.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash before rename")))
    with pytest.raises(OSError):
        ckpt.save_atomic({"v": 2}, path)
    assert ckpt.load_checkpoint(path)["v"] == 1
    assert os.listdir(tmp_path) == ["x.pt"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_checkpoint_takes_the_mode_the_umask_gives_a_new_file(tmp_path, umask, mode):
    # mkstemp's temporary file is 0600 whatever the umask, and the renamed checkpoint kept it: the
    # group a run's folder is shared with could not read it to resume, beside a readable config.json
    before = os.umask(umask)
    try:
        path = ckpt.save_checkpoint({"step": 1}, tmp_path, 1, keep=2)
    finally:
        os.umask(before)
    assert path.stat().st_mode & 0o777 == mode
    assert os.listdir(tmp_path) == [path.name]


class WatchedEnvironment:
    """``os.environ`` that records the names read through it."""

    def __init__(self, environ) -> None:
        self.environ, self.read = environ, []

    def __getattr__(self, name):
        return getattr(self.environ, name)

    def get(self, key, default=None):
        self.read.append(key)
        return self.environ.get(key, default)

    def __getitem__(self, key):
        self.read.append(key)
        return self.environ[key]

    def __contains__(self, key):
        self.read.append(key)
        return key in self.environ


def test_a_checkpoint_write_reads_no_environment(tmp_path):
    """The save path holds no test hook (kill tests hold writes open from their own process:
    tests/helpers/held_checkpoint_writes.py)."""
    watched = os.environ = WatchedEnvironment(os.environ)
    try:
        ckpt.save_checkpoint({"step": 1, "w": torch.arange(10)}, tmp_path, 1, keep=2)
    finally:
        os.environ = watched.environ
    assert watched.read == [] and ckpt.load_checkpoint(tmp_path / "ckpt-00000001.pt")["step"] == 1
