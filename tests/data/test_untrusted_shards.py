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
from vitlab.data.stream import open_source


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
