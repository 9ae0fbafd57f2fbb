"""Damaged shards: the samples before the damage are read, the rest is skipped and
counted, and the stream carries on with the next shard."""
import io
import logging
import tarfile

import numpy as np
import pytest
from PIL import Image

from vitlab.data import shards as shards_module
from vitlab.data.shards import read_shard
from vitlab.data.sources import DataError
from vitlab.data.stream import StreamLoader, open_source


def png(value):
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), value, np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def write_shard(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, value, label in samples:
            for ext, data in (("png", png(value)), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def values(folder, skipped):
    """The pixel value of every sample of the shards in ``folder``, shard after shard."""
    out = []
    for shard in sorted(folder.glob("*.tar")):
        out += [int(np.asarray(Image.open(io.BytesIO(data)))[0, 0, 0]) for _, data, _ in read_shard(shard, skipped)]
    return out


def test_truncated_shard_yields_what_precedes_the_damage(tmp_path, caplog):
    folder = tmp_path / "s"
    folder.mkdir()
    first = write_shard(folder / "shard-000000.tar", [(f"{i:03d}", 10 + i, 0) for i in range(5)])
    data = first.read_bytes()
    first.write_bytes(data[:5000])  # each sample is 2 x (512-byte header + 512-byte block): cut in sample 2
    write_shard(folder / "shard-000001.tar", [("100", 50, 1), ("101", 51, 1)])
    skipped = []
    with caplog.at_level(logging.WARNING, logger="vitlab.data.shards"):
        got = values(folder, skipped)
    assert got == [10, 11, 50, 51]
    assert [name for name, _ in skipped] == ["shard-000000.tar"]
    assert "unreadable from here on (truncated or corrupt?)" in skipped[0][1]
    assert "unreadable from here on" not in caplog.text  # the caller keeping the list reports it, counted
    with caplog.at_level(logging.WARNING, logger="vitlab.data.shards"):
        assert len(list(read_shard(first))) == 2  # no list: the reader warns itself
    assert "unreadable from here on" in caplog.text


def test_a_shard_of_garbage_is_skipped(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "shard-000000.tar").write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)  # a broken gzip
    write_shard(folder / "shard-000001.tar", [("a", 7, 0)])
    skipped = []
    assert values(folder, skipped) == [7]
    assert [name for name, _ in skipped] == ["shard-000000.tar"]


def test_oversized_member_is_skipped_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(shards_module, "MAX_MEMBER_BYTES", 100)
    folder = tmp_path / "s"
    folder.mkdir()
    write_shard(folder / "shard-000000.tar", [("a", 1, 0), ("b", 2, 0)])  # PNGs are ~70 bytes
    with tarfile.open(folder / "shard-000001.tar", "w") as tar:
        data = bytes(1000)
        info = tarfile.TarInfo("c.png")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("c.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"0"))
    skipped = []
    assert values(folder, skipped) == [1, 2]
    assert skipped == [("shard-000001.tar:c", "a member declares 1000 bytes, more than 100 (a tar bomb?)")]


@pytest.mark.parametrize("text", ["{", "[]", '{"classes": ["a"]}', '{"classes": 3, "num_samples": 1}'])
def test_malformed_index_json(tmp_path, text):
    folder = tmp_path / "s"
    folder.mkdir()
    write_shard(folder / "shard-000000.tar", [("a", 1, 0)])
    (folder / "index.json").write_text(text)
    with pytest.raises(DataError, match=r"index\.json: not an index written by pack_shards"):
        open_source(str(folder))


@pytest.fixture
def cut_shards(tmp_path, make_folder):
    """(shard folder, the cut shard, images it held, images read from it): 30 images packed 6 a shard,
    the second shard cut inside the header of its second sample, where tarfile stops without a word."""
    from vitlab.data.shards import pack_shards

    pack_shards(make_folder(classes=3, per_class=10), tmp_path / "shards", samples_per_shard=6)
    cut = tmp_path / "shards" / "shard-000001.tar"
    data = cut.read_bytes()
    cut.write_bytes(data[:2 * 1024 + 100])  # a sample: an 8x8 PNG and its label, each a header and one block
    kept = []
    read = sum(1 for _ in read_shard(cut, kept))
    assert read < 6 and "no end-of-archive block" in kept[-1][1]
    return tmp_path / "shards", cut, 6, read


def test_a_cut_shard_decoded_into_memory_is_named_and_counted(cut_shards, tmp_path, caplog):
    from vitlab.data.memory import load_in_memory

    folder, cut, held, read = cut_shards
    for attempt in ("decoded", "cached"):  # never silent, cached or not
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            data = load_in_memory(str(folder), cache_dir=tmp_path / "cache", workers=1)
        assert len(data) == 30 - (held - read) and data.skipped.images == held - read, attempt
        assert f"{cut}: {held - read} of its {held} images could not be read" in caplog.text, attempt
        assert f"skipped {held - read} unreadable image(s) of 30" in caplog.text, attempt


def test_a_cut_shard_met_by_worker_processes_is_counted_in_the_training_process(cut_shards, caplog):
    folder, cut, held, read = cut_shards
    loader = StreamLoader(open_source(str(folder)), 6, image_size=8, workers=2, shuffle_buffer=0)
    with caplog.at_level(logging.WARNING):  # what the training process logs: the workers' own logs are not here
        next(iter(loader))  # each worker's first handover holds more than a pass over its shards
    assert loader.unread.images == held - read and [where for where, _ in loader.unread] == [str(cut)]
    assert caplog.text.count(f"{cut}: {held - read} of its {held} images could not be read") == 1
    assert loader.state_dict()["unread"] == [(str(cut), held - read, loader.unread.entries[str(cut)][1], held)]


def test_an_unindexed_cut_shard_is_refused_when_counted(cut_shards):
    folder, cut, _, _ = cut_shards
    (folder / "index.json").unlink()
    (folder / "classes.txt").write_text("class_0\nclass_1\nclass_2\n")
    with pytest.raises(DataError, match=f"{cut}: not a readable tar shard"):
        open_source(str(folder))
