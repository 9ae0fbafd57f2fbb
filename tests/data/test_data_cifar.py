"""Tests for vitlab.data.cifar on a tiny fake tarball (never the network)."""
import hashlib
import io
import os
import pickle
import tarfile

import numpy as np
import pytest
from PIL import Image

from vitlab.data.cifar import TEST_BATCHES, TRAIN_BATCHES, download_cifar10, verify_md5
from vitlab.data.memory import load_in_memory
from vitlab.data.sources import DataError

CLASSES = [b"airplane", b"automobile", b"bird"]


def fake_batch(seed: int, n: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": [seed % 3, (seed + 1) % 3][:n]}


@pytest.fixture
def fake_tarball(tmp_path, fakes):
    batches = {name: fake_batch(i) for i, name in enumerate((*TRAIN_BATCHES, *TEST_BATCHES))}
    path = tmp_path / "src" / "cifar-10-python.tar.gz"
    path.parent.mkdir()
    with tarfile.open(path, "w:gz") as tar:
        for name, batch in batches.items():
            fakes.add_bytes(tar, f"cifar-10-batches-py/{name}", pickle.dumps(batch))
        fakes.add_bytes(tar, "cifar-10-batches-py/batches.meta", pickle.dumps({b"label_names": CLASSES}))
    return path, hashlib.md5(path.read_bytes()).hexdigest(), batches


def test_download_verifies_and_converts(tmp_path, fake_tarball):
    path, md5, batches = fake_tarball
    out = download_cifar10(tmp_path / "dest", url=path.as_uri(), md5=md5)
    assert out == tmp_path / "dest" / "cifar10"
    assert sorted(os.listdir(out / "train")) == ["airplane", "automobile", "bird"]
    # The first training image: batch 1's row 0, label 0 -> train/airplane/00000.png.
    row = batches["data_batch_1"][b"data"][0]
    png = np.asarray(Image.open(out / "train" / "airplane" / "00000.png"))
    assert png.shape == (32, 32, 3)
    assert np.array_equal(png[..., 0].ravel(), row[:1024]) and np.array_equal(png[..., 2].ravel(), row[2048:])
    train = load_in_memory(out / "train", cache_dir=tmp_path / "cache", workers=1)
    test = load_in_memory(out / "test", cache_dir=tmp_path / "cache", workers=1)
    assert len(train) == 10 and len(test) == 2
    assert train.classes == ["airplane", "automobile", "bird"]
    # A second call is a no-op.
    assert download_cifar10(tmp_path / "dest", url="file:///nonexistent", md5=md5) == out


def test_checksum_mismatch_deletes_and_explains(tmp_path, fake_tarball):
    path, _, _ = fake_tarball
    with pytest.raises(DataError, match="does not match"):
        download_cifar10(tmp_path / "dest", url=path.as_uri(), md5="0" * 32)
    assert not (tmp_path / "dest" / "cifar-10-python.tar.gz").exists()
    assert not (tmp_path / "dest" / "cifar10").exists()


def test_verify_md5_accepts_the_right_sum(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"hello")
    verify_md5(f, "5d41402abc4b2a76b9719d911017c592")
    assert f.exists()


def test_refuses_pickles_that_are_not_plain_data(tmp_path, fakes):
    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in (*TRAIN_BATCHES, *TEST_BATCHES):
            fakes.add_bytes(tar, name, pickle.dumps(fake_batch(0)))
        fakes.add_bytes(tar, "batches.meta", pickle.dumps({b"label_names": Evil()}))
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    with pytest.raises(DataError, match="refusing to unpickle"):
        download_cifar10(tmp_path / "dest", url=archive.as_uri(), md5=md5)
