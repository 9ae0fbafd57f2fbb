"""A hostile CIFAR tarball: class names cannot leave the output folder, damaged batches
and labels are a DataError, and nothing is left half-converted."""
import io
import os
import pickle
import tarfile

import numpy as np
import pytest

from vitlab.data.cifar import TEST_BATCHES, TRAIN_BATCHES, convert_cifar_python
from vitlab.data.sources import DataError


def batch(labels=(0, 1)):
    return {b"data": np.zeros((len(labels), 3072), np.uint8), b"labels": list(labels)}


def tarball(path, meta, batches=None, raw=None):
    with tarfile.open(path, "w") as tar:
        members = {name: pickle.dumps((batches or {}).get(name, batch())) for name in (*TRAIN_BATCHES, *TEST_BATCHES)}
        members["batches.meta"] = pickle.dumps(meta)
        members.update(raw or {})
        for name, data in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("names, match", [
    ([b"../../escape", b"b"], r"label name b'\.\./\.\./escape' cannot be a folder name"),
    ([b"/abs", b"b"], r"label name b'/abs'"),
    ([b"..", b"b"], r"label name b'\.\.'"),
    ([b"a", b"a"], r"label names repeat"),
    ([], r"label_names must be a non-empty list"),
])
def test_hostile_class_names(tmp_path, names, match):
    src = tarball(tmp_path / "c.tar", {b"label_names": names})
    with pytest.raises(DataError, match=match):
        convert_cifar_python(src, tmp_path / "work" / "out")
    assert not (tmp_path / "escape").exists() and not os.path.exists("/abs")
    assert not (tmp_path / "work").exists() or os.listdir(tmp_path / "work") == []


@pytest.mark.parametrize("bad, match", [
    ({"data_batch_1": batch(labels=(0, 7))}, r"a label outside 0\.\.1"),
    ({"data_batch_1": batch(labels=(0, -1))}, r"a label outside 0\.\.1"),
    ({"data_batch_1": {b"labels": [0]}}, r"lacks \(N, 3072\) uint8 'data'"),
    ({"data_batch_1": {b"data": np.zeros((1, 5), np.uint8), b"labels": [0]}}, r"lacks"),
])
def test_bad_batches(tmp_path, bad, match):
    src = tarball(tmp_path / "c.tar", {b"label_names": [b"a", b"b"]}, bad)
    with pytest.raises(DataError, match=match):
        convert_cifar_python(src, tmp_path / "work" / "out")
    assert os.listdir(tmp_path / "work") == []  # the partial tree is removed


def test_damaged_pickle_and_damaged_archive(tmp_path):
    src = tarball(tmp_path / "c.tar", {b"label_names": [b"a", b"b"]}, raw={"data_batch_2": b"\x80\x04garbage"})
    with pytest.raises(DataError, match="a CIFAR batch cannot be unpickled"):
        convert_cifar_python(src, tmp_path / "out")
    data = src.read_bytes()
    src.write_bytes(data[:700])
    with pytest.raises(DataError, match=r"c\.tar: (not a readable tar archive|not the CIFAR-10 python tarball)"):
        convert_cifar_python(src, tmp_path / "out2")
