"""Tests for vitlab.data.memory: decoding into RAM, caching, corrupt images."""
import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab import machine
from vitlab.data import memory
from vitlab.data.memory import load_in_memory
from vitlab.data.sources import DataError


def test_decodes_folder_exactly(make_folder, fakes, tmp_path):
    root = make_folder(classes=2, per_class=3, size=(6, 5))
    data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert data.images.dtype == torch.uint8 and data.images.shape == (6, 3, 6, 5)
    assert data.labels.dtype == torch.int64 and data.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert data.classes == ["class_0", "class_1"] and list(data.skipped) == []
    for i in range(6):  # PNG is lossless: every pixel is known
        expected = torch.from_numpy(fakes.image_with_id(i, (6, 5))).permute(2, 0, 1)
        assert torch.equal(data.images[i], expected)


def test_no_worker_count_decodes_on_every_usable_core(make_folder, tmp_path, monkeypatch):
    """None (a library call that names no count) decodes on every usable core; a run passes the
    count its resolution decided (``train/resolve.py``)."""
    root = make_folder(classes=2, per_class=3, size=(6, 5))
    asked = []
    decode_all = memory._decode_all
    monkeypatch.setattr(memory, "_decode_all", lambda sources, size, workers: asked.append(workers)
                        or decode_all(sources, size, workers))
    auto = load_in_memory(root, cache_dir=tmp_path / "auto", workers=None)
    one = load_in_memory(root, cache_dir=tmp_path / "one", workers=1)
    assert asked == [machine.usable_cores(), 1]
    assert torch.equal(auto.images, one.images) and torch.equal(auto.labels, one.labels)


def test_second_call_reads_the_cache(make_folder, tmp_path, monkeypatch):
    root = make_folder()
    first = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(memory, "_decode_all", no_decoding)
    second = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert torch.equal(first.images, second.images) and torch.equal(first.labels, second.labels)
    assert second.classes == first.classes
    # A different image size is a different cache entry.
    with pytest.raises(AssertionError, match="decoded again"):
        load_in_memory(root, image_size=4, cache_dir=tmp_path / "cache", workers=1)


@pytest.mark.parametrize("form", ["folder", "archive", "shards"])
def test_each_image_s_stored_size_is_kept_cached_and_decoded_again_where_a_copy_lacks_it(make_folder, fakes, tmp_path,
                                                                                      form):
    """Each image's stored (height, width), which a training crop's geometry is of (the images are held
    stretched): recorded by the decoding, read back from the cache, and a copy cached without them (an
    earlier version's) is decoded again, not read as if the stretched size were the stored one."""
    from vitlab.data.shards import pack_shards

    root = make_folder(classes=2, per_class=3, size=(6, 10))
    source = {"folder": root, "archive": fakes.make_tar(root, tmp_path / "set.tar"),
              "shards": tmp_path / "shards"}[form]
    if form == "shards":
        pack_shards(root, source, samples_per_shard=4)
    cache = tmp_path / "cache"
    first = load_in_memory(source, 4, cache_dir=cache, workers=1)
    assert first.images.shape[-2:] == (4, 4) and first.sizes.dtype == torch.int64
    assert first.sizes.tolist() == [[6, 10]] * 6
    assert memory.is_decoded(source, 4, cache) and not memory.is_decoded(source, 5, cache)
    [folder] = (cache / "arrays").iterdir()
    assert torch.equal(load_in_memory(source, 4, cache_dir=cache, workers=1).sizes, first.sizes)  # the cache's
    (folder / memory.SIZES_FILE).unlink()
    assert not memory.is_decoded(source, 4, cache)  # decoded again, as a memory estimate counts it
    again = load_in_memory(source, 4, cache_dir=cache, workers=1)
    assert torch.equal(again.sizes, first.sizes) and torch.equal(again.images, first.images)
    assert (folder / memory.SIZES_FILE).is_file()


@pytest.mark.parametrize("damage", ["truncated", "empty", "no meta", "meta not json"])
def test_a_damaged_cached_copy_is_decoded_again_with_a_warning_naming_it(make_folder, tmp_path, caplog, damage):
    """A cached copy cut short (the machine stopped before its renamed files were on disk; one removed by
    hand): its error named no file ("Failed to read all data for array ... (file seems not fully written?)"),
    and every later run on the data stopped there until the cache folder was found and deleted."""
    root = make_folder(classes=2, per_class=3)
    first = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    [folder] = (tmp_path / "cache" / "arrays").iterdir()
    images, meta = folder / "images.npy", folder / "meta.json"
    if damage == "truncated":
        images.write_bytes(images.read_bytes()[:-40])
    elif damage == "empty":
        images.write_bytes(b"")
    elif damage == "no meta":
        meta.unlink()
    else:
        meta.write_text("{")
    with caplog.at_level(logging.WARNING):
        again = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert torch.equal(again.images, first.images) and torch.equal(again.labels, first.labels)
    assert f"{folder}: the decoded copy cached there cannot be read" in caplog.text
    caplog.clear()
    assert torch.equal(load_in_memory(root, cache_dir=tmp_path / "cache", workers=1).images, first.images)
    assert caplog.text == ""  # cached again, whole


def test_cache_invalidated_when_folder_changes(make_folder, fakes, tmp_path):
    root = make_folder(classes=2, per_class=2)
    assert len(load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)) == 4
    Image.fromarray(fakes.image_with_id(99)).save(root / "class_1" / "extra.png")
    assert len(load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)) == 5


def test_cache_invalidated_when_an_empty_class_folder_comes_or_goes(make_folder, tmp_path):
    """A class folder without images renumbers the classes after it: the cached copy kept the class
    list it was decoded with, where a streamed read or pack-shards of the folder took the new one."""
    root = make_folder(classes=2, per_class=2)
    assert load_in_memory(root, cache_dir=tmp_path / "cache", workers=1).classes == ["class_0", "class_1"]
    (root / "class_00").mkdir()
    data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert data.classes == ["class_0", "class_00", "class_1"] and data.labels.tolist() == [0, 0, 2, 2]
    (root / "class_00").rmdir()
    assert load_in_memory(root, cache_dir=tmp_path / "cache", workers=1).labels.tolist() == [0, 0, 1, 1]


def test_cache_invalidated_when_the_class_names_beside_shards_change(make_folder, tmp_path):
    from vitlab.data.shards import pack_shards

    pack_shards(make_folder(classes=2, per_class=2), tmp_path / "shards", samples_per_shard=2)
    (tmp_path / "shards" / "index.json").unlink()
    names = tmp_path / "shards" / "classes.txt"
    names.write_text("cat\ndog\n")
    assert load_in_memory(str(tmp_path / "shards"), cache_dir=tmp_path / "cache", workers=1).classes == ["cat", "dog"]
    names.write_text("dog\ncat\n")  # a list written in the wrong order, put right: the shards are as they were
    again = load_in_memory(str(tmp_path / "shards"), cache_dir=tmp_path / "cache", workers=1)
    assert again.classes == ["dog", "cat"]  # the cached copy's names were taken: every label under another name


def test_an_archive_decoded_before_its_links_were_read_is_decoded_again(make_folder, fakes, tmp_path):
    """An archive's key is its path, size and time, which a change to how it is read leaves as it
    was: the copy version 2 cached, its links left out (and its __MACOSX/ read as a class), was
    read back, other images than an extraction's."""
    import tarfile

    from vitlab.data.sources import source_key

    archive = fakes.make_tar(make_folder(classes=2, per_class=1), tmp_path / "set.tar")
    with tarfile.open(archive, "a") as tar:
        info = tarfile.TarInfo("class_1/again.png")
        info.type, info.linkname = tarfile.LNKTYPE, "class_0/0000.png"
        tar.addfile(info)
    folder = tmp_path / "cache" / "arrays" / f"{source_key(archive)}-native-v2"  # as version 2 wrote it
    pixels = np.zeros((2, 3, 8, 8), np.uint8)
    memory._write_cache(folder, pixels, np.array([0, 1]), ["class_0", "class_1"], memory.Unread())
    assert load_in_memory(archive, cache_dir=tmp_path / "cache", workers=1).labels.tolist() == [0, 1, 1]


def test_archive_gives_the_same_arrays_as_the_folder(make_folder, fakes, tmp_path):
    root = make_folder(classes=3, per_class=2, subdir="train")
    archive = fakes.make_tar(root, tmp_path / "set.tar.gz")
    from_folder = load_in_memory(root, cache_dir=tmp_path / "c1", workers=1)
    from_archive = load_in_memory(archive, cache_dir=tmp_path / "c2", workers=1)
    assert torch.equal(from_folder.images, from_archive.images)
    assert torch.equal(from_folder.labels, from_archive.labels)
    assert not (tmp_path / "c2" / "extracted").exists()  # read in one pass, not extracted


def test_process_pool_matches_single_process(make_folder, tmp_path):
    root = make_folder(classes=2, per_class=80, size=(4, 4))  # > 64 per chunk: several jobs
    one = load_in_memory(root, cache_dir=tmp_path / "c1", workers=1)
    two = load_in_memory(root, cache_dir=tmp_path / "c2", workers=2)
    assert torch.equal(one.images, two.images) and torch.equal(one.labels, two.labels)


def test_different_sizes_need_image_size(make_folder, fakes, tmp_path):
    root = make_folder(classes=2, per_class=2, size=(8, 8))
    Image.fromarray(fakes.image_with_id(7, (10, 6))).save(root / "class_0" / "odd.png")
    with pytest.raises(DataError, match="image_size"):
        load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    data = load_in_memory(root, image_size=(5, 7), cache_dir=tmp_path / "cache", workers=1)
    assert data.images.shape == (5, 3, 5, 7)


def test_grayscale_and_rgba_become_rgb(make_folder, tmp_path):
    root = make_folder(classes=1, per_class=1)
    Image.fromarray(np.full((8, 8), 77, np.uint8), "L").save(root / "class_0" / "gray.png")
    Image.fromarray(np.full((8, 8, 4), 200, np.uint8), "RGBA").save(root / "class_0" / "rgba.png")
    data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert data.images.shape == (3, 3, 8, 8)
    assert (data.images[1] == 77).all() and (data.images[2] == 200).all()


def test_corrupt_images_skipped_counted_and_logged(make_folder, tmp_path, caplog):
    root = make_folder(classes=2, per_class=3, fmt="jpg")
    good = (root / "class_0" / "0000.jpg").read_bytes()
    (root / "class_0" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "class_1" / "garbage.jpg").write_bytes(b"definitely not a jpeg")
    with caplog.at_level(logging.WARNING, logger="vitlab.data.memory"):
        data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert len(data) == 6 and data.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert sorted(p.rsplit("/", 1)[-1] for p, _ in data.skipped) == ["garbage.jpg", "truncated.jpg"]
    assert all(reason for _, reason in data.skipped)
    assert "skipped 2 unreadable image(s) of 8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitlab.data.memory"):
        cached = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert len(cached.skipped) == 2 and "skipped 2" in caplog.text  # never silent, cached or not


def test_a_folder_of_links_pointed_at_other_images_is_decoded_again(tmp_path):
    """vtab's split views are links to the task's images: pointed at others of the same size and time
    (a new --split-seed), the folder kept its key, and the cached earlier split was decoded in its place."""
    images = tmp_path / "images"
    images.mkdir()
    for value in (10, 200):
        Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(images / f"{value}.bmp")
        os.utime(images / f"{value}.bmp", ns=(10**18, 10**18))  # the same size and time
    view = tmp_path / "view" / "a"
    view.mkdir(parents=True)
    means = []
    for value in (10, 200):
        (view / "0.bmp").unlink(missing_ok=True)
        (view / "0.bmp").symlink_to(images / f"{value}.bmp")
        data = load_in_memory(view.parent, image_size=8, cache_dir=tmp_path / "cache", workers=1)
        means.append(float(data.images.float().mean()))
    assert means == [10.0, 200.0]


def test_a_class_folder_linked_to_other_images_is_decoded_again(tmp_path):
    """A class folder that is a link (a tree of links to another's class folders, one version of a set
    or another): pointed at a folder of other images of the same names, sizes and times (uncompressed,
    extracted together), the tree kept its key, and the cached images of the earlier folder were read."""
    for version, value in (("v1", 10), ("v2", 200)):
        for c in ("a", "b"):
            (tmp_path / version / c).mkdir(parents=True)
            Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(tmp_path / version / c / "0.bmp")
            os.utime(tmp_path / version / c / "0.bmp", ns=(10**18, 10**18))  # the same size and time
    tree = tmp_path / "tree"
    tree.mkdir()
    means = []
    for version in ("v1", "v2"):
        for c in ("a", "b"):
            (tree / c).unlink(missing_ok=True)
            (tree / c).symlink_to(tmp_path / version / c, target_is_directory=True)
        data = load_in_memory(tree, image_size=8, cache_dir=tmp_path / "cache", workers=1)
        means.append(float(data.images.float().mean()))
    assert means == [10.0, 200.0]
