"""Tests for vitlab.data.shards: packing tar shards and streaming them across ranks/workers."""
import json
import logging
import tarfile

import pytest
import torch
from torch.utils.data import DataLoader

from vitlab.data.shards import FolderStream, ShardStream, collate_samples, pack_shards
from vitlab.data.sources import DataError, scan_image_folder


@pytest.fixture
def packed(tmp_path, make_folder):
    root = make_folder(classes=3, per_class=10)  # 30 images, ids 0..29, label = id // 10
    return pack_shards(root, tmp_path / "shards", samples_per_shard=4, seed=1), tmp_path / "shards"


def test_pack_writes_named_shards_and_index(packed):
    shards, folder = packed
    assert [p.name for p in shards] == [f"shard-{i:06d}.tar" for i in range(8)]
    meta = json.loads((folder / "index.json").read_text())
    assert meta["classes"] == ["class_0", "class_1", "class_2"] and meta["num_samples"] == 30
    assert [s["num_samples"] for s in meta["shards"]] == [4] * 7 + [2]
    assert [sum(c) for c in zip(*[s["class_counts"] for s in meta["shards"]])] == [10, 10, 10]
    with tarfile.open(shards[0]) as tar:
        names = tar.getnames()
    assert names == ["000000000.png", "000000000.cls", "000000001.png", "000000001.cls",
                     "000000002.png", "000000002.cls", "000000003.png", "000000003.cls"]


def test_pack_is_shuffled_and_deterministic(tmp_path, make_folder, fakes):
    root = make_folder(classes=2, per_class=6)
    a = pack_shards(root, tmp_path / "a", samples_per_shard=5, seed=0)
    b = pack_shards(root, tmp_path / "b", samples_per_shard=5, seed=0)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    ids = [fakes.id_of(x) for x, _ in ShardStream(tmp_path / "a", shuffle_buffer=0)]
    assert sorted(ids) == list(range(12)) and ids != list(range(12))
    with pytest.raises(DataError, match="already holds shards"):
        pack_shards(root, tmp_path / "a")


def test_single_reader_yields_every_sample_with_its_label(packed, fakes):
    _, folder = packed
    stream = ShardStream(folder, shuffle_buffer=8, seed=0)
    samples = list(stream)
    ids = [fakes.id_of(x) for x, _ in samples]
    assert sorted(ids) == list(range(30))
    assert all(label == fakes.id_of(x) // 10 for x, label in samples)
    x, _ = samples[0]
    assert x.dtype == torch.uint8 and x.shape == (3, 8, 8)
    assert stream.classes == ["class_0", "class_1", "class_2"] and stream.num_samples == 30
    stream.set_epoch(1)
    assert [fakes.id_of(x) for x, _ in stream] != ids  # reshuffled per epoch


def test_two_ranks_two_workers_cover_every_sample_exactly_once(packed, fakes):
    _, folder = packed
    seen, per_reader_shards = [], []
    for rank in range(2):
        stream = ShardStream(folder, shuffle_buffer=4, seed=2, rank=rank, world_size=2)
        loader = DataLoader(stream, batch_size=3, num_workers=2, collate_fn=collate_samples)
        for images, labels in loader:
            assert images.shape[1:] == (3, 8, 8) and labels.dtype == torch.int64
            seen.extend(fakes.id_of(x) for x in images)
    assert sorted(seen) == list(range(30))


def test_shards_are_dealt_disjointly(packed, monkeypatch):
    _, folder = packed
    dealt = []
    for rank in range(2):
        for worker in range(2):
            # What DataLoader's get_worker_info tells worker ``worker`` of 2.
            info = type("WorkerInfo", (), {"id": worker, "num_workers": 2})()
            monkeypatch.setattr("vitlab.data.shards.get_worker_info", lambda info=info: info)
            dealt.append(ShardStream(folder, seed=0, rank=rank, world_size=2).my_shards())
    flat = [p.name for part in dealt for p in part]
    assert sorted(flat) == [f"shard-{i:06d}.tar" for i in range(8)] and all(len(p) == 2 for p in dealt)


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
    stream = ShardStream(tmp_path / "s", shuffle_buffer=0)
    with caplog.at_level(logging.WARNING, logger="vitlab.data.shards"):
        ids = [fakes.id_of(x) for x, _ in stream]
    assert ids == [0, 2]
    assert sorted(name for name, _ in stream.skipped) == ["shard-000000.tar:b", "shard-000000.tar:c"]
    assert "skipped" in caplog.text


def test_folder_stream_with_workers_and_a_corrupt_file(make_folder, fakes):
    root = make_folder(classes=2, per_class=3, size=(6, 6))
    (root / "class_1" / "zz.png").write_bytes(b"broken")
    dataset = FolderStream.from_path(root, image_size=4)
    assert len(dataset) == 7 and dataset[6] is None
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_samples)
    batches = list(loader)
    assert sum(len(y) for _, y in batches) == 6 and batches[0][0].shape == (4, 3, 4, 4)
    assert torch.cat([y for _, y in batches]).tolist() == [0, 0, 0, 1, 1, 1]
