"""Hostile archives: nothing is written outside the cache folder, the cache is never
left half-extracted, tar bombs and damaged archives are refused with a message."""
import io
import logging
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from vitlab.data import sources
from vitlab.data.memory import load_in_memory
from vitlab.data.sources import ArchiveLimits, DataError, read_image_archive, resolve_data_path, source_key


def png_bytes(value=0):
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value, np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def member(name, data=b"", **fields):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in fields.items():
        setattr(info, k, v)
    return info, io.BytesIO(data) if data else None


def make_archive(path, extra=(), images=2):
    """An ImageFolder archive (two classes of ``images`` PNGs) plus ``extra`` members."""
    with tarfile.open(path, "w") as tar:
        for c in ("cat", "dog"):
            for i in range(images):
                tar.addfile(*member(f"train/{c}/{i}.png", png_bytes(i)))
        for info, data in extra:
            tar.addfile(info, data)
    return path


def snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def sandbox(tmp_path):
    """tmp_path/outside must stay untouched; the cache is tmp_path/cache."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("keep")
    return tmp_path


ESCAPES = [
    ("dotdot", [member("train/../../outside/evil.png", b"x")], r"refusing member 'train/\.\./\.\./outside/evil\.png'"),
    ("absolute", [member("/tmp/vitlab-evil.png", b"x")], r"refusing member '/tmp/vitlab-evil\.png'"),
    ("symlink-out", [member("train/cat/link", type=tarfile.SYMTYPE, linkname="../../../outside")],
     r"refusing link 'train/cat/link' -> '\.\./\.\./\.\./outside'"),
    ("symlink-abs", [member("train/cat/passwd", type=tarfile.SYMTYPE, linkname="/etc/passwd")],
     r"refusing link 'train/cat/passwd' -> '/etc/passwd'"),
    ("hardlink-abs", [member("train/cat/hard", type=tarfile.LNKTYPE, linkname="/etc/passwd")],
     r"refusing link 'train/cat/hard' -> '/etc/passwd'"),
    ("hardlink-out", [member("train/cat/hard", type=tarfile.LNKTYPE, linkname="../outside/keep.txt")],
     r"refusing link"),
]


@pytest.mark.parametrize("kind, extra, match", ESCAPES, ids=[e[0] for e in ESCAPES])
def test_escaping_members_are_refused_and_nothing_is_written(sandbox, kind, extra, match):
    archive = make_archive(sandbox / "data.tar", extra)
    before = snapshot(sandbox / "outside")
    with pytest.raises(DataError, match=match):
        resolve_data_path(archive, sandbox / "cache")
    assert snapshot(sandbox / "outside") == before
    assert not os.path.exists("/tmp/vitlab-evil.png")
    assert os.listdir(sandbox / "cache" / "extracted") == []  # no final folder, no partial one


def test_symlink_chain_through_the_data_filter(sandbox):
    """A link inside the tree that the name checks allow, then a file written through it:
    the standard library's data filter refuses it."""
    extra = [member("train/cat/up", type=tarfile.SYMTYPE, linkname="."),
             member("train/cat/up/x.png", png_bytes())]
    archive = make_archive(sandbox / "data.tar", extra)
    try:
        folder = resolve_data_path(archive, sandbox / "cache")
    except DataError:
        folder = None
    assert snapshot(sandbox / "outside") == ["keep.txt"]
    if folder is not None:  # allowed: the file stays inside the extracted tree
        assert all(p.resolve().is_relative_to(folder.resolve()) for p in folder.rglob("*.png"))


def test_device_files_are_skipped_with_a_message(sandbox, caplog):
    extra = [member("train/cat/tty", type=tarfile.CHRTYPE, devmajor=5, devminor=0),
             member("train/dog/fifo", type=tarfile.FIFOTYPE)]
    archive = make_archive(sandbox / "data.tar", extra)
    with caplog.at_level(logging.WARNING, logger="vitlab.data.sources"):
        folder = resolve_data_path(archive, sandbox / "cache")
    assert "skipped 2 device/FIFO member(s) (first: train/cat/tty)" in caplog.text
    assert sorted(p.name for p in (folder / "train" / "cat").iterdir()) == ["0.png", "1.png"]
    assert not (folder / "train" / "dog" / "fifo").exists()


def test_links_are_skipped_when_reading_an_archive_into_memory(sandbox, caplog):
    extra = [member("train/cat/passwd.png", type=tarfile.SYMTYPE, linkname="/etc/passwd")]
    archive = make_archive(sandbox / "data.tar", extra)
    with caplog.at_level(logging.WARNING, logger="vitlab.data.sources"):
        index, blobs = read_image_archive(archive)
    assert len(blobs) == 4 and index.classes == ["cat", "dog"]
    assert "skipped 1 link/device member(s) (first: train/cat/passwd.png)" in caplog.text


def test_links_to_the_archives_images_are_read_into_memory_as_extracted(sandbox, caplog):
    """A hard link (what GNU tar stores for a second name of one file) or a symbolic link inside
    the tree is the image it names, in memory as on disk: read into memory it was skipped, and a
    run held other images (and so another split) than streaming or pack-shards of the archive."""
    extra = [member("train/dog/again.png", type=tarfile.LNKTYPE, linkname="./train/cat/1.png"),
             member("train/cat/alias.png", type=tarfile.SYMTYPE, linkname="0.png"),
             member("train/dog/chain.png", type=tarfile.SYMTYPE, linkname="../cat/alias.png"),  # '..': refused
             member("train/dog/nowhere.png", type=tarfile.SYMTYPE, linkname="missing.png")]
    archive = make_archive(sandbox / "data.tar", extra)
    with caplog.at_level(logging.WARNING, logger="vitlab.data.sources"):
        index, blobs = read_image_archive(archive)
    names = [p[len(str(archive)) + 1:] for p in index.paths]
    assert names == ["train/cat/0.png", "train/cat/1.png", "train/cat/alias.png", "train/dog/0.png",
                     "train/dog/1.png", "train/dog/again.png"]
    assert blobs[2] == blobs[0] == png_bytes(0) and blobs[5] == blobs[1] == png_bytes(1)
    assert "skipped 2 link/device member(s) (first: train/dog/chain.png)" in caplog.text
    archive = make_archive(sandbox / "fine.tar", extra[:2])  # an extraction refuses the archive over '..'
    extracted = sources.scan_image_folder(resolve_data_path(archive, sandbox / "cache"))
    index = read_image_archive(archive)[0]
    assert [p[len(str(archive)) + 1:] for p in index.paths] == [
        os.path.relpath(p, extracted.root.parent) for p in extracted.paths] == names
    assert index.labels.tolist() == extracted.labels.tolist()


def test_tar_bomb_of_many_small_files(sandbox, monkeypatch):
    archive = make_archive(sandbox / "bomb.tar", [member(f"train/cat/{i}.txt", b"x") for i in range(60)])
    monkeypatch.setenv("VITLAB_MAX_ARCHIVE_MEMBERS", "50")
    with pytest.raises(DataError, match=r"bomb\.tar: more than 50 members \(a tar bomb\?\)"):
        resolve_data_path(archive, sandbox / "cache")
    assert os.listdir(sandbox / "cache" / "extracted") == []
    with pytest.raises(DataError, match="more than 50 members"):
        read_image_archive(archive)
    with pytest.raises(DataError, match="more than 50 members"):
        load_in_memory(archive, cache_dir=sandbox / "cache", workers=1)


def test_tar_bomb_with_a_huge_declared_size(sandbox, monkeypatch):
    """A header that declares 10 TB, with a few bytes behind it: refused from the header."""
    archive = sandbox / "huge.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for c in ("cat", "dog"):
            tar.addfile(*member(f"train/{c}/0.png", png_bytes()))
        end = tar.offset  # where the end-of-archive blocks start
    info = tarfile.TarInfo("train/cat/huge.png")
    info.size = 10 * 10**12
    archive.write_bytes(buffer.getvalue()[:end] + info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * 2048)
    with pytest.raises(DataError, match=r"huge\.tar: declares more than"):
        resolve_data_path(archive, sandbox / "cache")
    assert os.listdir(sandbox / "cache" / "extracted") == []
    with pytest.raises(DataError, match=r"huge\.tar: (declares more than|member 'train/cat/huge\.png' declares)"):
        read_image_archive(archive)


def test_limits_given_as_arguments_leave_the_environment_unread(sandbox, monkeypatch):
    """The environment is the default of the public calls only: with ``limits`` passed, a
    variable that would be refused is never read, at the top or below it."""
    archive = make_archive(sandbox / "bomb.tar", [member(f"train/cat/{i}.txt", b"x") for i in range(60)])
    monkeypatch.setenv("VITLAB_MAX_ARCHIVE_MEMBERS", "lots")
    with pytest.raises(DataError, match=r"bomb\.tar: more than 50 members"):
        resolve_data_path(archive, sandbox / "cache", limits=ArchiveLimits(members=50))
    with pytest.raises(DataError, match="more than 50 members"):
        read_image_archive(archive, limits=ArchiveLimits(members=50))
    fine = make_archive(sandbox / "fine.tar")
    assert resolve_data_path(fine, sandbox / "cache", limits=ArchiveLimits(members=100)).is_dir()
    with pytest.raises(DataError, match="VITLAB_MAX_ARCHIVE_MEMBERS='lots'"):  # left None: read, and refused
        resolve_data_path(make_archive(sandbox / "other.tar"), sandbox / "cache")


def test_limit_from_the_environment_must_be_a_number(monkeypatch):
    monkeypatch.setenv("VITLAB_MAX_ARCHIVE_BYTES", "lots")
    with pytest.raises(DataError, match=r"\$VITLAB_MAX_ARCHIVE_BYTES='lots': must be a positive integer"):
        ArchiveLimits.from_env()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "gzip"])
def test_damaged_archives_are_a_clear_error_and_leave_no_cache(sandbox, damage):
    archive = make_archive(sandbox / "data.tar")
    data = archive.read_bytes()
    if damage == "truncate":
        archive.write_bytes(data[:1000])
    elif damage == "garbage":
        archive.write_bytes(b"\x00\xff" * 700)
    else:
        archive = sandbox / "data.tar.gz"
        import gzip

        archive.write_bytes(gzip.compress(data)[:-200])
    with pytest.raises(DataError, match=r"data\.tar(\.gz)?: "):
        resolve_data_path(archive, sandbox / "cache")
    assert os.listdir(sandbox / "cache" / "extracted") == []


def test_interrupted_extraction_leaves_nothing_and_is_redone(sandbox, monkeypatch):
    archive = make_archive(sandbox / "data.tar")
    real = sources._extract

    def interrupted(path, target, limits=None):
        (target / "half").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(sources, "_extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_data_path(archive, sandbox / "cache")
    assert os.listdir(sandbox / "cache" / "extracted") == []
    monkeypatch.setattr(sources, "_extract", real)
    folder = resolve_data_path(archive, sandbox / "cache")
    assert sorted(p.name for p in (folder / "train" / "dog").iterdir()) == ["0.png", "1.png"]


@pytest.mark.slow
def test_a_killed_extraction_is_detected_and_redone(sandbox, caplog):
    """SIGKILL runs no cleanup: the partial folder of a dead process is removed and the
    extraction redone; a partial folder of a live process is left alone."""
    archive = make_archive(sandbox / "data.tar")
    extracted = sandbox / "cache" / "extracted"
    extracted.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    key = source_key(archive)
    stale = extracted / f".{key}.{dead_pid}.abcd.partial"
    (stale / "train" / "cat").mkdir(parents=True)
    (stale / "train" / "cat" / "0.png").write_bytes(b"half")
    live = extracted / f".{key}.1.efgh.partial"  # pid 1 is always alive
    live.mkdir()
    with caplog.at_level(logging.WARNING, logger="vitlab.data.sources"):
        folder = resolve_data_path(archive, sandbox / "cache")
    assert "half-extracted folder left by a killed run" in caplog.text
    assert not stale.exists() and live.exists()
    assert folder.name == key and (folder / "train" / "cat" / "0.png").read_bytes() == png_bytes(0)


def test_an_archive_packed_inside_the_archive_is_named_in_the_refusal(sandbox):
    """A .tar.gz holding the .tar of an ImageFolder (packed twice): refused as holding no class folders, without a
    word of the archive inside, which is not opened; the line names it and what to do (read and counted alike)."""
    from vitlab.data.sources import count_archive_images

    inner = make_archive(sandbox / "inner.tar")
    outer = sandbox / "outer.tar.gz"
    with tarfile.open(outer, "w:gz") as tar:
        tar.add(inner, arcname="inner.tar")
    said = (r"outer\.tar\.gz: no class folders found \(expected <root>/<class>/<image>\); it holds an archive, "
            r"inner\.tar, which is not opened: give that archive itself as the data \(a \.zip extracted first\)$")
    with pytest.raises(DataError, match=said):
        load_in_memory(str(outer), image_size=(4, 4), cache_dir=sandbox / "cache")
    with pytest.raises(DataError, match=said):
        count_archive_images(outer)
