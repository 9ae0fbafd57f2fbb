"""vitlab.files: a file replaced so that a failure or a crash leaves the old one or the new one."""
import os
import stat

import pytest

from vitlab import files
from vitlab.files import atomic_write, atomic_write_text

posix_modes = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_file_is_written_whole_with_its_folder_made(tmp_path):
    path = tmp_path / "a" / "b" / "f.json"
    assert atomic_write(path, lambda f: f.write(b"new")) == path
    assert path.read_bytes() == b"new"
    assert atomic_write_text(str(path), "caf\u00e9") == path  # a str path; text in UTF-8
    assert path.read_bytes() == "caf\u00e9".encode("utf-8")
    assert os.listdir(path.parent) == ["f.json"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path, error):
    path = tmp_path / "f.json"
    path.write_bytes(b"old and whole")

    def half_then_fail(f):
        f.write(b"new, half")
        raise error

    with pytest.raises(type(error)):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old and whole"
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_failure_at_the_sync_or_the_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    path.write_bytes(b"old")

    def full(*args):
        raise OSError(28, "No space left on device")

    for name in ("fsync", "replace"):
        with monkeypatch.context() as m:
            m.setattr(os, name, full)
            with pytest.raises(OSError, match="No space left"):
                atomic_write_text(path, "new")
        assert path.read_bytes() == b"old"
        assert os.listdir(tmp_path) == ["f.json"]


def test_a_full_disk_leaves_the_old_file_where_writing_in_place_truncates_it(tmp_path, monkeypatch):
    # the helper the callers' tests use: it fills the disk as the named file (or its temporary) is opened
    from helpers.full_disk import fill_disk_at

    path = tmp_path / "summary.json"
    path.write_text('{"old": 1}')
    fill_disk_at(monkeypatch, path.name)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(path, '{"new": 1}')
    assert path.read_text() == '{"old": 1}' and os.listdir(tmp_path) == ["summary.json"]
    with pytest.raises(OSError, match="No space left"):
        path.write_text('{"new": 1}')  # in place: opened, truncated, then the disk is full
    assert path.read_text() == ""


@posix_modes
def test_a_new_file_has_the_mode_the_umask_gives(tmp_path):
    # tempfile.mkstemp's file is 0600 whatever the umask: renamed into place, a file in a shared
    # folder was unreadable to the group
    for umask, expected in ((0o022, 0o644), (0o027, 0o640), (0o002, 0o664)):
        path = tmp_path / f"new-{umask:o}"
        old = os.umask(umask)
        try:
            atomic_write(path, lambda f: f.write(b"x"))
        finally:
            os.umask(old)
        assert mode(path) == expected


@posix_modes
def test_a_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    for kept in (0o600, 0o640, 0o666):
        os.chmod(path, kept)
        atomic_write(path, lambda f: f.write(b"new"))
        assert mode(path) == kept and path.read_bytes() == b"new"


def test_a_folder_is_refused_by_its_own_name(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError) as err:
        atomic_write(tmp_path / "d", lambda f: f.write(b"x"))
    assert str(err.value) == f"{tmp_path / 'd'} is a folder; expected a file to write"  # not the temporary's
    assert os.listdir(tmp_path) == ["d"] and os.listdir(tmp_path / "d") == []


def test_each_write_draws_a_temporary_of_its_own(tmp_path, monkeypatch):
    # a fixed name was written by two writers at once, and one renamed the other's half-written file into place
    path = tmp_path / "f"
    names = iter(["aaaaaaaaaaaa", "aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    fd, first = files.new_temporary(path)
    os.close(fd)
    fd, second = files.new_temporary(path)  # the first name is taken: drawn again
    os.close(fd)
    assert (os.path.basename(first), os.path.basename(second)) == (".f.aaaaaaaaaaaa.tmp", ".f.bbbbbbbbbbbb.tmp")
