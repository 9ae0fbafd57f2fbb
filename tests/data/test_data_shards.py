"""Tar shards: packing them (as stored, or shrunk and re-encoded), and reading them through
the one streaming stack in DataLoader workers."""
import hashlib
import io
import json
import logging
import shutil
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data.decode import decode_image
from vitlab.data.shards import pack_shards, read_shard
from vitlab.data.sources import DataError, scan_image_folder
from vitlab.data.stream import StreamLoader, open_source


@pytest.fixture
def packed(tmp_path, make_folder):
    root = make_folder(classes=3, per_class=10)  # 30 images, ids 0..29, label = id // 10
    return pack_shards(root, tmp_path / "shards", samples_per_shard=4, seed=1), tmp_path / "shards"


def ids_in_order(folder, fakes):
    """(id, label) of every sample of a shard set, in stored order."""
    source = open_source(str(folder))
    return [(fakes.id_of(decode_image(io.BytesIO(data)).transpose(2, 0, 1)), label)
            for _, data, label in source.samples()]


def test_pack_writes_named_shards_and_index(packed):
    shards, folder = packed
    assert [p.name for p in shards] == [f"shard-{i:06d}.tar" for i in range(8)]
    meta = json.loads((folder / "index.json").read_text())
    assert meta["classes"] == ["class_0", "class_1", "class_2"] and meta["num_samples"] == 30
    assert [s["num_samples"] for s in meta["shards"]] == [4] * 7 + [2]
    assert [sum(c) for c in zip(*[s["class_counts"] for s in meta["shards"]])] == [10, 10, 10]
    assert meta["max_side"] is None and meta["quality"] is None and meta["skipped"] == []
    # each shard's sha256 as sha256sum gives it: what a streamed run names its training shards by (units_key)
    assert [s["sha256"] for s in meta["shards"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards]
    with tarfile.open(shards[0]) as tar:
        names = tar.getnames()
    assert names == ["000000000.png", "000000000.cls", "000000001.png", "000000001.cls",
                     "000000002.png", "000000002.cls", "000000003.png", "000000003.cls"]


def test_pack_is_shuffled_deterministic_and_keeps_every_label(tmp_path, make_folder, fakes):
    root = make_folder(classes=2, per_class=6)
    a = pack_shards(root, tmp_path / "a", samples_per_shard=5, seed=0)
    b = pack_shards(root, tmp_path / "b", samples_per_shard=5, seed=0)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    samples = ids_in_order(tmp_path / "a", fakes)
    ids = [i for i, _ in samples]
    assert sorted(ids) == list(range(12)) and ids != list(range(12))
    assert all(label == i // 6 for i, label in samples)
    with pytest.raises(DataError, match="already holds shards"):
        pack_shards(root, tmp_path / "a")


def test_pack_max_side_shrinks_large_images_and_keeps_small_ones(tmp_path):
    root = tmp_path / "folder"
    rng = np.random.default_rng(0)
    sizes = {"big": (60, 40), "tall": (20, 48), "small": (16, 12)}  # (width, height)
    for name, (w, h) in sizes.items():
        (root / name).mkdir(parents=True)
        smooth = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
        pixels = np.clip(smooth + rng.normal(0, 3, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / name / "0.png")
    pack_shards(root, tmp_path / "shards", samples_per_shard=2, max_side=24, workers=2)
    meta = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert meta["max_side"] == 24 and meta["quality"] == 90 and meta["num_samples"] == 3
    stored = {}
    for shard in sorted((tmp_path / "shards").glob("*.tar")):
        for key, data, label in read_shard(shard):
            with Image.open(io.BytesIO(data)) as img:
                stored[meta["classes"][label]] = (img.format, img.size, np.asarray(img.convert("RGB")))
    assert stored["big"][:2] == ("JPEG", (24, 16)) and stored["tall"][:2] == ("JPEG", (10, 24))
    assert stored["small"][:2] == ("PNG", (16, 12))  # within max_side: stored byte for byte
    # shrinking keeps the picture: the left-to-right ramp survives
    ramp = stored["big"][2][:, :, 0].mean(0)
    assert ramp[0] < 40 and ramp[-1] > 215 and np.all(np.diff(ramp) > -12)
    with pytest.raises(DataError, match="quality=0"):
        pack_shards(root, tmp_path / "bad", quality=0)


def test_pack_quality_alone_reencodes_every_image(tmp_path, make_folder):
    root = make_folder(classes=1, per_class=2, size=(8, 8))
    pack_shards(root, tmp_path / "shards", quality=95)
    with tarfile.open(tmp_path / "shards" / "shard-000000.tar") as tar:
        assert [n.rsplit(".", 1)[1] for n in tar.getnames()] == ["jpg", "cls", "jpg", "cls"]


def test_workers_read_their_readers_samples_in_order(packed, fakes):
    # rank 0 of 2, two DataLoader worker processes: the first micro-batch is reader 0's first
    # two samples, then reader 1's, exactly as the stream's deal says
    _, folder = packed
    source = open_source(str(folder))
    loader = StreamLoader(source, 4, image_size=8, seed=2, shuffle_buffer=4, rank=0, world_size=2, workers=2)
    x, y = next(iter(loader))
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.uint8 and y.dtype == torch.int64
    expected = []
    for worker in range(2):
        keys = loader.dataset.keys(0, 0, 2, worker, 2)
        expected += [fakes.id_of(decode_image(io.BytesIO(next(keys)[1])).transpose(2, 0, 1)) for _ in range(2)]
    assert [fakes.id_of(image) for image in x] == expected
    assert y.tolist() == [i // 10 for i in expected]


def test_corrupt_samples_are_skipped_and_counted(tmp_path, make_folder, fakes, caplog):
    root = make_folder(classes=1, per_class=3)
    index = scan_image_folder(root)
    shard = tmp_path / "s" / "shard-000000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        fakes.add_bytes(tar, "a.png", open(index.paths[0], "rb").read())
        fakes.add_bytes(tar, "a.cls", b"0")
        fakes.add_bytes(tar, "b.jpg", b"\xff\xd8 not really a jpeg")  # undecodable
        fakes.add_bytes(tar, "b.cls", b"0")
        fakes.add_bytes(tar, "c.png", open(index.paths[1], "rb").read())  # no label
        fakes.add_bytes(tar, "d.png", open(index.paths[2], "rb").read())
        fakes.add_bytes(tar, "d.cls", b"0")
    (tmp_path / "s" / "classes.txt").write_text("only\n")
    skipped = []
    assert [key for key, _, _ in read_shard(shard, skipped)] == ["shard-000000.tar:a", "shard-000000.tar:b",
                                                                 "shard-000000.tar:d"]
    assert [name for name, _ in skipped] == ["shard-000000.tar:c"]
    with caplog.at_level(logging.WARNING, logger="vitlab.data.stream"):
        x, _ = next(iter(StreamLoader(open_source(str(tmp_path / "s")), 2, image_size=8, shuffle_buffer=0,
                                      workers=0)))
    assert [fakes.id_of(image) for image in x] == [0, 2]
    assert "shard-000000.tar:b: skipped unreadable image" in caplog.text


@pytest.mark.parametrize("listed", ["index.json", "classes.txt"])
def test_the_resource_forks_of_a_macos_tar_are_no_samples(tmp_path, make_folder, fakes, listed):
    """tar on macOS writes a ``._<name>`` member (the file's extended attributes) before each file
    that has any: read as members of samples, each began a sample of its own between an image and its
    label, every sample was cut in two and left out ("bad or missing label"), and counted from the
    headers the ``._`` members were one more sample.  A ``__MACOSX/`` folder beside the shards (an
    unzipped macOS zip) made the folder an ImageFolder ("no class folders found").  WebDataset skips
    such members, and vitlab's ImageFolder readers such files and folders."""
    from vitlab.data.memory import load_in_memory
    from vitlab.data.sources import Unread

    packed = tmp_path / "packed"
    pack_shards(make_folder(classes=2, per_class=3), packed, samples_per_shard=3)
    mac, fork = tmp_path / "mac", b"\0\5\26\7\0\2\0\0Mac OS X        "
    mac.mkdir()
    for shard in sorted(packed.glob("shard-*.tar")):
        with tarfile.open(shard) as src, tarfile.open(mac / shard.name, "w") as dst:
            for member in src.getmembers():
                fakes.add_bytes(dst, f"./._{member.name}", fork)
                fakes.add_bytes(dst, f"./{member.name}", src.extractfile(member).read())
            fakes.add_bytes(dst, ".DS_Store", b"\0\0\0\1Bud1")
            fakes.add_bytes(dst, f"__MACOSX/._{member.name}", fork)
    if listed == "index.json":
        shutil.copy(packed / "index.json", mac)
    else:
        (mac / "classes.txt").write_text("class_0\nclass_1\n")
    (mac / "__MACOSX").mkdir()
    (mac / "__MACOSX" / "._shard-000000.tar").write_bytes(fork)
    source, unread = open_source(str(mac)), Unread()
    assert source.unit_sizes == [3, 3]
    samples = [(key.replace("./", ""), data, label) for key, data, label in source.samples(unread)]
    assert samples == list(open_source(str(packed)).samples()) and not unread.entries
    ours, theirs = (load_in_memory(str(folder), cache_dir=tmp_path / "cache", workers=1) for folder in (mac, packed))
    assert torch.equal(ours.images, theirs.images) and torch.equal(ours.labels, theirs.labels) and len(ours) == 6


@pytest.mark.parametrize("max_side", [None, 4])
def test_pack_leaves_out_an_image_it_cannot_read_and_says_so(tmp_path, make_folder, caplog, max_side):
    """A link to nothing (its set moved) stopped pack-shards half-way with a bare "[Errno 2] No such
    file or directory", the shards written so far left in the output; a run of the folder skips it."""
    root = make_folder(classes=2, per_class=2)
    (root / "class_1" / "gone.png").symlink_to(tmp_path / "moved.png")
    with caplog.at_level(logging.WARNING, logger="vitlab.data.shards"):
        pack_shards(root, tmp_path / "out", samples_per_shard=2, max_side=max_side)
    meta = json.loads((tmp_path / "out" / "index.json").read_text())
    assert meta["num_samples"] == 4 and sum(s["num_samples"] for s in meta["shards"]) == 4
    assert meta["skipped"] == [[str(root / "class_1" / "gone.png"), "not readable: FileNotFoundError: No such file "
                                                                      "or directory"]]
    assert f"left out 1 image(s) that could not be read or decoded (first: {root / 'class_1' / 'gone.png'}: " \
           "not readable" in caplog.text


def test_folder_streamed_by_workers_with_a_corrupt_file(make_folder, fakes):
    root = make_folder(classes=2, per_class=3, size=(6, 6))
    (root / "class_1" / "zz.png").write_bytes(b"broken")
    source = open_source(str(root))
    assert source.num_samples == 7 and source.classes == ["class_0", "class_1"]
    x, y = next(iter(StreamLoader(source, 6, image_size=4, shuffle_buffer=0, workers=2)))
    assert x.shape == (6, 3, 4, 4)
    assert sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]  # the broken image left out, every other one read


def test_pack_shards_command_resizes_and_refuses_bad_options(tmp_path, make_folder, capsys):
    from vitlab.cli import main

    root = make_folder(classes=2, per_class=3, size=(30, 40))
    assert main(["pack-shards", str(root), str(tmp_path / "s"), "--per-shard", "4", "--max-side", "20",
                 "--quality", "80", "--workers", "2"]) == 0
    meta = json.loads((tmp_path / "s" / "index.json").read_text())
    assert (meta["max_side"], meta["quality"], meta["num_samples"], len(meta["shards"])) == (20, 80, 6, 2)
    for shard in sorted((tmp_path / "s").glob("*.tar")):
        for _, data, _ in read_shard(shard):
            assert Image.open(io.BytesIO(data)).size == (20, 15)
    capsys.readouterr()
    assert main(["pack-shards", str(root), str(tmp_path / "t"), "--quality", "101"]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab pack-shards: error: quality=101: a JPEG quality in 1..100 "
                                               "(ImageNet's files are about 90)")
    # a negative seed was numpy's "expected non-negative integer"; negative workers were taken without a word
    assert main(["pack-shards", str(root), str(tmp_path / "u"), "--seed", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "vitlab pack-shards: error: seed=-1: must be an integer >= 0"
    assert main(["pack-shards", str(root), str(tmp_path / "u"), "--workers", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab pack-shards: error: workers=-1: must be a number of processes "
                                               ">= 0 (0 or 1: this process alone)")
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("inside", ["", "class_0", "new/deeper"])
def test_pack_shards_refuses_an_output_in_the_source_folder_before_any_work(tmp_path, make_folder, capsys, inside):
    # the shards were packed among the images: the help promises an empty output folder
    from vitlab.cli import main

    root = make_folder(classes=2, per_class=2)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    out = root / inside if inside else root
    assert main(["pack-shards", str(root), str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab pack-shards: error: out_dir={str(out)!r} is the source folder "
                                               f"or inside it; expected an empty folder outside {root}")
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_pack_shards_takes_an_output_beside_the_source_whose_name_begins_as_its(tmp_path, make_folder):
    root = make_folder(classes=2, per_class=2, name="train")
    assert len(pack_shards(root, tmp_path / "train-shards", samples_per_shard=4)) == 1


def test_shards_of_two_pack_runs_are_refused_not_read_under_one_runs_classes(tmp_path):
    def folder(name, classes):
        for c in classes:
            (tmp_path / name / c).mkdir(parents=True)
            Image.new("RGB", (4, 4)).save(tmp_path / name / c / "0.png")
        return tmp_path / name

    pack_shards(folder("abc", "abc"), tmp_path / "a", samples_per_shard=1)
    pack_shards(folder("de", "de"), tmp_path / "d", samples_per_shard=1)
    # a glob over both folders: the second set's labels 0 and 1 (d, e) were read as a and b
    with pytest.raises(DataError, match=r"two sets with different classes: .*a has 3 classes \(a, b, c\), "
                                        r".*d has 2 classes \(d, e\)"):
        open_source(str(tmp_path / "[ad]" / "*.tar"))
    # a shard of the other run copied in beside the index that does not list it
    shutil.copy(tmp_path / "d" / "shard-000001.tar", tmp_path / "a" / "shard-000003.tar")
    with pytest.raises(DataError, match=r"shard-000003.tar: not one of the 3 shards its folder's index.json lists"):
        open_source(str(tmp_path / "a"))
    (tmp_path / "a" / "shard-000003.tar").unlink()
    assert open_source(str(tmp_path / "a")).classes == ["a", "b", "c"]
    shutil.copytree(tmp_path / "a", tmp_path / "a2")  # two folders of one class list: one set
    assert open_source(str(tmp_path / "a*" / "*.tar")).num_samples == 6
