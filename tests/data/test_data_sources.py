"""Tests for vitlab.data.sources: ImageFolder scanning and archive resolution."""
import logging
import tarfile

import numpy as np
import pytest

from vitlab.data import sources
from vitlab.data.sources import DataError, read_image_archive, resolve_data_path, scan_image_folder


def test_scan_direct_layout(make_folder):
    root = make_folder(classes=3, per_class=[2, 3, 1])
    (root / "README.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    index = scan_image_folder(root)
    assert index.classes == ["class_0", "class_1", "class_2"]
    assert index.labels.dtype == np.int64
    assert index.labels.tolist() == [0, 0, 1, 1, 1, 2]
    assert index.paths[2].endswith("class_1/0000.png")
    assert index.root == root and len(index) == 6


def test_scan_single_subfolder_layout_and_nested_images(make_folder):
    root = make_folder(classes=2, per_class=2, subdir="train")
    nested = root / "train" / "class_1" / "more"
    nested.mkdir()
    (root / "train" / "class_1" / "0000.png").rename(nested / "x.png")
    index = scan_image_folder(root)
    assert index.root == root / "train"
    assert index.classes == ["class_0", "class_1"]
    assert index.labels.tolist() == [0, 0, 1, 1]
    assert any(p.endswith("more/x.png") for p in index.paths)


def test_scan_sorts_classes_by_name(tmp_path, make_folder):
    root = make_folder(classes=2, per_class=1)
    (root / "class_1").rename(root / "aardvark")
    assert scan_image_folder(root).classes == ["aardvark", "class_0"]


def test_scan_errors_name_the_path(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no class folders") as info:
        scan_image_folder(empty)
    assert str(empty) in str(info.value)
    (empty / "a").mkdir()
    (empty / "a" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="no images"):
        scan_image_folder(empty)
    with pytest.raises(DataError, match="not a folder"):
        scan_image_folder(tmp_path / "missing")


def test_archive_extracted_once_and_reused(tmp_path, make_folder, fakes):
    archive = fakes.make_tar(make_folder(classes=2, per_class=2, subdir="train"), tmp_path / "set.tar.gz")
    cache = tmp_path / "cache"
    first = resolve_data_path(archive, cache)
    assert first.parent == cache / "extracted"
    assert scan_image_folder(first).classes == ["class_0", "class_1"]
    stamp = first.stat().st_mtime_ns, (first / "train" / "class_0" / "0000.png").stat().st_mtime_ns
    second = resolve_data_path(archive, cache)
    assert second == first
    assert (first.stat().st_mtime_ns, (first / "train" / "class_0" / "0000.png").stat().st_mtime_ns) == stamp
    assert [p.name for p in (cache / "extracted").iterdir()] == [first.name]  # no leftovers


def test_changed_archive_gets_a_new_folder(tmp_path, make_folder, fakes):
    archive = fakes.make_tar(make_folder(classes=2, per_class=1), tmp_path / "set.tar")
    first = resolve_data_path(archive, tmp_path / "cache")
    fakes.make_tar(make_folder(classes=3, per_class=1), archive)
    second = resolve_data_path(archive, tmp_path / "cache")
    assert second != first and len(scan_image_folder(second).classes) == 3


def test_directory_is_used_as_is(make_folder, tmp_path):
    root = make_folder()
    assert resolve_data_path(root, tmp_path / "cache") == root
    assert not (tmp_path / "cache").exists()


def test_default_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "c"))
    assert sources.default_cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("bad_name", ["../escape.png", "/abs/escape.png", "ok/../../escape.png"])
def test_path_traversal_refused(tmp_path, fakes, bad_name):
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        fakes.add_bytes(tar, "a/good.png", b"x")
        fakes.add_bytes(tar, bad_name, b"x")
    cache = tmp_path / "deep" / "cache"
    with pytest.raises(DataError, match="refusing") as info:
        resolve_data_path(archive, cache)
    assert str(archive) in str(info.value)
    assert list((cache / "extracted").iterdir()) == []  # the partial folder is gone too
    assert not (tmp_path / "deep" / "escape.png").exists() and not (tmp_path / "escape.png").exists()


def test_failed_extraction_leaves_nothing_that_looks_complete(tmp_path, make_folder, fakes, monkeypatch):
    archive = fakes.make_tar(make_folder(), tmp_path / "set.tar")

    def dies_halfway(path, target, limits):
        (target / "class_0").mkdir()
        raise KeyboardInterrupt  # as if the process were killed mid-extraction

    monkeypatch.setattr(sources, "_extract", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve_data_path(archive, tmp_path / "cache")
    assert list((tmp_path / "cache" / "extracted").iterdir()) == []
    monkeypatch.undo()
    assert len(scan_image_folder(resolve_data_path(archive, tmp_path / "cache"))) == 12


def test_unsupported_file_refused(tmp_path):
    (tmp_path / "data.zip").write_bytes(b"PK")
    with pytest.raises(DataError, match="archive"):
        resolve_data_path(tmp_path / "data.zip")


def test_read_image_archive_matches_folder_scan(tmp_path, make_folder, fakes):
    root = make_folder(classes=3, per_class=[1, 2, 3], subdir="train")
    archive = fakes.make_tar(root, tmp_path / "set.tgz")
    index, blobs = read_image_archive(archive)
    folder = scan_image_folder(root)
    assert index.classes == folder.classes
    assert index.labels.tolist() == folder.labels.tolist()
    assert [p[len(str(archive)) + 1 :] for p in index.paths] == [
        str(p)[len(str(root)) + 1 :] for p in folder.paths
    ]
    assert blobs[0] == open(folder.paths[0], "rb").read()


def test_links_to_class_folders_are_followed_and_a_loop_is_not(tmp_path, make_folder, caplog):
    """A tree of links to another's class folders (a subset made without copying) is read as
    those folders, as torchvision's ImageFolder reads it: unfollowed, each was a class without
    images, and a tree of links only was refused as holding no images."""
    from vitlab.data.sources import holds_class_images

    real = make_folder(classes=3, per_class=[1, 2, 3])
    subset = tmp_path / "subset"
    subset.mkdir()
    for name in ("class_1", "class_2"):
        (subset / name).symlink_to(real / name)
    assert holds_class_images(subset)
    index = scan_image_folder(subset)
    assert index.classes == ["class_1", "class_2"] and index.labels.tolist() == [0, 0, 1, 1, 1]
    assert index.paths[0] == str(subset / "class_1" / "0000.png")
    (real / "class_2" / "up").symlink_to(real)  # a link to a folder above it: followed, it would loop
    with caplog.at_level(logging.WARNING, logger="vitlab.data.sources"):
        assert scan_image_folder(real).labels.tolist() == [0, 1, 1, 2, 2, 2]
        assert scan_image_folder(subset).labels.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]  # up/class_0 and up/class_1
    assert f"not following {real / 'class_2' / 'up'}: a link to a folder above it (a loop)" in caplog.text


def test_the_resource_forks_of_a_macos_zip_are_not_a_class(tmp_path, make_folder, fakes):
    """A zip made on macOS unzips to ``__MACOSX/`` beside the tree, holding a ``._`` file for each
    image: read as a class, it was a second top folder, and every class folder of ``train/``
    became one class, ``train``."""
    root = make_folder(classes=2, per_class=2, subdir="train")
    for image in (root / "train").rglob("*.png"):
        fork = root / "__MACOSX" / image.relative_to(root).parent / f"._{image.name}"
        fork.parent.mkdir(parents=True, exist_ok=True)
        fork.write_bytes(b"\0\5\26\7")
    for index in (scan_image_folder(root), read_image_archive(fakes.make_tar(root, tmp_path / "set.tar"))[0]):
        assert index.classes == ["class_0", "class_1"] and index.labels.tolist() == [0, 0, 1, 1]
