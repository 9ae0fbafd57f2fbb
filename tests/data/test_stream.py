"""Streamed training data: sources, the split over ranks x workers, seeded order, resume."""
import io
import json
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.multi_label import multi_label_shard
from vitlab.data.decode import SampleCrop
from vitlab.data.shards import pack_shards
from vitlab.data.sources import DataError
from vitlab.data.stream import (StreamDataset, StreamLoader, expand_braces, hold_out, is_stream_source, open_source,
                                parts_per_handover, split_handover)
from vitlab.data.transforms import TrainTransform

CROP = SampleCrop((8, 8))


def write_folder(root, classes=3, per_class=10, size=8):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return root


@pytest.fixture
def shards(tmp_path):
    pack_shards(write_folder(tmp_path / "folder"), tmp_path / "shards", samples_per_shard=3)  # 30 samples, 10 shards
    return tmp_path / "shards"


def all_keys(ds, epoch, world, workers):
    return [k for r in range(world) for w in range(workers) for k, _, _ in ds.keys(epoch, r, world, w, workers)]


def test_expand_braces():
    assert expand_braces("s/{008..011}.tar") == ["s/008.tar", "s/009.tar", "s/010.tar", "s/011.tar"]
    assert expand_braces("{1..2}-{0..1}") == ["1-0", "1-1", "2-0", "2-1"]
    with pytest.raises(DataError, match="backwards"):
        expand_braces("{3..1}.tar")


def test_two_ranks_two_workers_see_every_sample_exactly_once(shards):
    source = open_source(str(shards))
    assert source.num_samples == 30 and source.classes == ["class0", "class1", "class2"]
    ds = StreamDataset(source, [4], crop=CROP, seed=3, shuffle_buffer=5)
    truth = sorted(k for u in source.units for k, _, _ in source.read(u))
    for epoch in (0, 1):
        keys = all_keys(ds, epoch, world=2, workers=2)
        assert Counter(keys) == Counter(truth)  # every key once, none twice, none missing
    # each reader's share is disjoint from the others' and not empty
    shares = [{k for k, _, _ in ds.keys(0, r, 2, w, 2)} for r in range(2) for w in range(2)]
    assert all(shares) and sum(map(len, shares)) == 30


def test_same_seed_same_order_other_seed_or_epoch_other_order(shards):
    source = open_source(str(shards))

    def order(seed, epoch):
        return [k for k, _, _ in StreamDataset(source, [4], crop=CROP, seed=seed).keys(epoch, 1, 2, 0, 2)]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)


def test_brace_pattern_and_folder_sources(shards, tmp_path):
    pattern = str(shards / "shard-{000000..000009}.tar")
    assert is_stream_source(pattern) and is_stream_source(str(shards))
    assert len(open_source(pattern).units) == 10
    folder = write_folder(tmp_path / "big", classes=2, per_class=300)
    assert not is_stream_source(str(folder))
    source = open_source(str(folder))
    ds = StreamDataset(source, [4], crop=CROP, seed=0)
    keys = all_keys(ds, 0, world=2, workers=2)
    assert len(keys) == 600 and len(set(keys)) == 600


def test_hidden_files_and_folders_beside_shards_are_not_data(shards):
    """Jupyter's .ipynb_checkpoints (index.json opened in it) and the ._ files macOS writes on a
    foreign disk: the folder was read as an ImageFolder, "no class folders", or ._shard-000000.tar
    as a shard its index.json does not list."""
    (shards / ".ipynb_checkpoints").mkdir()
    (shards / ".ipynb_checkpoints" / "index-checkpoint.json").write_text("{}")
    (shards / "._shard-000000.tar").write_bytes(b"\0\5\26\7")
    assert is_stream_source(str(shards))
    assert len(open_source(str(shards)).units) == 10


def test_a_folder_whose_name_holds_pattern_characters_is_that_folder(tmp_path):
    """``data [v2]`` or ``photos*`` names a folder, not a glob: it was refused as "the pattern
    matches no file" (or read as the files the pattern matched)."""
    for name in ("set [v2]", "set*", "shards {0..1}"):
        folder = write_folder(tmp_path / name, classes=2, per_class=2)
        assert not is_stream_source(str(folder))
        assert open_source(str(folder)).num_samples == 4
    pack_shards(tmp_path / "set*", tmp_path / "packed [1]", samples_per_shard=2)
    assert open_source(str(tmp_path / "packed [1]")).num_samples == 4


def test_foreign_shards_with_json_labels_and_classes_txt(tmp_path):
    out = tmp_path / "webds"
    out.mkdir()
    for s in range(2):
        with tarfile.open(out / f"{s:04d}.tar", "w") as tar:
            for i in range(3):
                buf = io.BytesIO()
                Image.new("RGB", (5, 7), (s, i, 0)).save(buf, format="JPEG")
                for name, data in ((f"{s}{i:04d}.jpg", buf.getvalue()),
                                   (f"{s}{i:04d}.json", json.dumps({"label": i % 2}).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    with pytest.raises(DataError, match="classes.txt"):
        open_source(str(out))
    (out / "classes.txt").write_text("cat\ndog\n")
    source = open_source(str(out / "{0000..0001}.tar"))
    assert source.num_samples == 6 and source.classes == ["cat", "dog"]
    handover = next(iter(StreamDataset(source, [6], crop=CROP, shuffle_buffer=0)))
    # each tensor a worker hands over costs the training process a file descriptor's transfer: one
    # per handover, which holds the parts of the next 6 micro-batches (32 images at least)
    assert [type(v) for v in handover if isinstance(v, torch.Tensor)] == [torch.Tensor]
    parts = split_handover(handover)
    assert len(parts) == parts_per_handover(6) == 6
    x, y = parts[0][:2]
    assert x.shape == (6, 8, 8, 3) and x.dtype == torch.uint8 and sorted(y) == [0, 0, 0, 0, 1, 1]
    assert [part[5:] for part in parts] == [(epoch, 6) for epoch in range(6)]  # each part a whole epoch here


@pytest.mark.parametrize("written, names", [
    ('{"dog": 1, "cat": 0}', ["cat", "dog"]),  # torchvision's class_to_idx
    ('{"1": "dog", "0": "cat"}', ["cat", "dog"]),  # an id2label
    ('[0, 1]', r"TypeError: expected names \(strings\), found \[0, 1\]"),
    ('{"dog": 1, "cat": 1}', "ValueError: the ids are not 0 to 1"),
    ('["cat", "dog",', "JSONDecodeError"),
])
def test_classes_json_is_names_in_label_order_or_refused_naming_it(shards, written, names):
    """A mapping was read as its keys in the file's order: {"dog": 1, "cat": 0} named label 0 dog;
    a list of numbers became the names, and a file that is not JSON ended in json's own line."""
    (shards / "index.json").unlink()
    (shards / "classes.json").write_text(written)
    if isinstance(names, list):
        assert open_source(str(shards)).classes == names
        return
    with pytest.raises(DataError, match=rf"classes.json: not class names in label order \(.*\): {names}"):
        open_source(str(shards))
    (shards / "classes.json").unlink()
    (shards / "classes.txt").write_bytes(b"cat\n\xff\n")
    with pytest.raises(DataError, match=r"classes.txt: not class names in label order \(.*\): UnicodeDecodeError"):
        open_source(str(shards))


def test_resume_continues_sample_exactly(shards):
    source = open_source(str(shards))

    def loader():
        return StreamLoader(source, 4, image_size=(8, 8), seed=1, shuffle_buffer=4, workers=2)

    straight = loader()
    it = iter(straight)
    expected = [next(it) for _ in range(12)]  # more than an epoch (30 samples): crosses into epoch 1
    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a round trip through JSON
    it = iter(resumed)
    for want in expected[5:]:
        x, y = next(it)
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    other = StreamLoader(source, 4, image_size=(8, 8), seed=1, workers=1)
    with pytest.raises(DataError, match="workers=2"):
        other.load_state_dict(state)


def test_resume_refuses_another_shuffle_buffer_or_another_set(shards):
    # either reorders what each reader hands out: skipping the samples counted in the checkpoint
    # would then skip others than were trained on (some twice in the epoch, some never), silently
    source = open_source(str(shards))
    first = StreamLoader(source, 4, image_size=(8, 8), seed=1, shuffle_buffer=4, workers=2)
    it = iter(first)
    next(it)
    state = first.state_dict()
    del it
    other_buffer = StreamLoader(source, 4, image_size=(8, 8), seed=1, shuffle_buffer=8, workers=2)
    with pytest.raises(DataError, match=r"data.shuffle_buffer=4; this run has 8"):
        other_buffer.load_state_dict(state)
    fewer = StreamLoader(source.subset(range(9), "training"), 4, image_size=(8, 8), seed=1, shuffle_buffer=4,
                         workers=2)
    with pytest.raises(DataError, match=r"10 unit\(s\) of 30 samples; this run's has 9 of 27"):
        fewer.load_state_dict(state)
    StreamLoader(source, 4, image_size=(8, 8), seed=1, shuffle_buffer=4, workers=2).load_state_dict(state)


def test_multi_label_samples_give_multi_hot_targets(tmp_path):
    out = tmp_path / "jft"
    out.mkdir()
    (out / "classes.txt").write_text("a\nb\nc\nd\n")
    labels = [[0, 2], [1], [3, 1, 0]]
    with tarfile.open(out / "0000.tar", "w") as tar:
        for i, label in enumerate(labels):
            buf = io.BytesIO()
            Image.new("RGB", (8, 8), (i, 0, 0)).save(buf, format="PNG")
            members = ((f"{i:04d}.png", buf.getvalue()), (f"{i:04d}.json", json.dumps({"labels": label}).encode()))
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    source = open_source(str(out))

    def targets(**augment):
        augment = TrainTransform(num_classes=4, image_size=(8, 8), crop="none", flip=False, **augment)
        return next(iter(StreamLoader(source, 3, augment=augment, shuffle_buffer=0, workers=0)))[1]

    assert targets().tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1]]
    with pytest.raises(DataError, match="label_smoothing=0"):
        targets(label_smoothing=0.1)
    with pytest.raises(DataError, match="mixup_alpha=0"):
        targets(mixup_alpha=0.2)


def test_a_multi_label_set_whose_samples_have_one_label_or_several_streams(tmp_path):
    # JFT-style .cls labels: "0,2" is a tuple, "1" an int; the label check took every label of a part
    # holding both as a tuple and stopped the run with "TypeError: 'int' object is not iterable"
    out = multi_label_shard(tmp_path / "jft", ["0,2", "1", "3,1,0"])
    augment = TrainTransform(num_classes=4, image_size=(8, 8), crop="none", flip=False)
    loader = StreamLoader(open_source(str(out)), 3, augment=augment, shuffle_buffer=0, workers=0)
    assert next(iter(loader))[1].tolist() == [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1]]


def test_a_micro_batch_is_augmented_at_once_and_mixup_pairs_images_of_other_readers(shards):
    augment = TrainTransform(num_classes=3, image_size=(8, 8), crop="none", flip=False, mixup_alpha=1.0)
    loader = StreamLoader(open_source(str(shards)), 4, augment=augment, workers=2)

    def part(worker, label):  # (images, labels, multi-labels, ids, worker, epoch, consumed)
        return torch.full((2, 8, 8, 3), 100 * label, dtype=torch.uint8), [label] * 2, None, [0, 1], worker, 0, 2

    x, y = loader._on_device([part(0, 0), part(1, 1)])
    assert x.shape == (4, 3, 8, 8) and y.shape == (4, 3)
    torch.testing.assert_close(y.sum(-1), torch.ones(4))
    # each image is mixed with the one before it: the first of each reader's with the other reader's last
    assert (y[[0, 2], :2] > 0).all() and (y[[1, 3]].max(-1).values == 1).all()
    again = loader._on_device([part(0, 0), part(1, 1)])
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])  # a function of the parts' places


def test_too_few_shards_for_the_workers_asked_is_one_warning_saying_how_many(shards, caplog):
    source = open_source(str(shards))  # 10 shards
    with caplog.at_level("WARNING", logger="vitlab.data.stream"):
        loader = StreamLoader(source, 8, image_size=(8, 8), world_size=2, workers=8)
    assert loader.workers == 5 and loader.dataset.part_sizes == [2, 2, 2, 1, 1]
    assert "10 unit(s) (shards) for 2 process(es) x 8 workers" in caplog.text
    assert "write at least 16 shards (vitlab pack-shards --per-shard" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="vitlab.data.stream"):
        assert StreamLoader(source, 8, image_size=(8, 8), world_size=2, workers=5).workers == 5
    assert caplog.text == ""


def test_a_micro_batch_smaller_than_the_workers_is_said_to_be_the_limit_not_the_shards(shards, caplog):
    # 10 shards are enough for 2 x 2 readers; a micro-batch of 1 is not: more shards would not help
    with caplog.at_level("WARNING", logger="vitlab.data.stream"):
        assert StreamLoader(open_source(str(shards)), 1, image_size=(8, 8), world_size=2, workers=2).workers == 1
    assert "micro-batch 1: 1 DataLoader worker(s) per process instead of 2" in caplog.text
    assert "each reader makes a part of every micro-batch" in caplog.text and "pack-shards" not in caplog.text


def test_held_out_units_are_seeded_whole_and_refused_when_they_would_take_all(shards):
    source = open_source(str(shards))  # 10 shards of 3
    rest, held = hold_out(source, 7, seed=0)
    assert held.num_samples == 9 and rest.num_samples == 21 and len(held.units) == 3  # whole shards: 7 -> 9
    assert set(map(str, rest.units)).isdisjoint(map(str, held.units))
    assert hold_out(source, 0.2, seed=0)[1].num_samples == 6
    assert hold_out(source, 7, seed=1)[1].units != held.units
    with pytest.raises(DataError, match="nothing to train on"):
        hold_out(source, 30, seed=0)


def test_a_readers_error_in_a_worker_process_is_its_own_line_not_the_workers_traceback(shards):
    for shard in shards.glob("shard-*.tar"):  # every sample undecodable: the reader itself gives up
        with tarfile.open(shard) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        with tarfile.open(shard, "w") as tar:
            for member, data in members:
                data = b"not an image" if not member.name.endswith(".cls") else data
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    source = open_source(str(shards))
    augment = TrainTransform(num_classes=3, image_size=(8, 8), crop="none", flip=False)
    with pytest.raises(DataError) as raised:
        next(iter(StreamLoader(source, 30, augment=augment, shuffle_buffer=0, workers=1)))
    # it was "Caught DataError in DataLoader worker process 0." and the worker's traceback, printed whole
    assert str(raised.value).startswith(f"{source.name}: reader 0 (rank 0, worker 0) could decode none of its samples")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_label_past_the_class_list_stops_the_run_in_one_line(shards, tmp_path, workers):
    from vitlab.data.memory import load_in_memory

    (shards / "index.json").unlink()
    (shards / "classes.txt").write_text("class0\nclass1\n")  # one class short: labels 0-2 read under two names
    source = open_source(str(shards))
    augment = TrainTransform(num_classes=2, image_size=(8, 8), crop="none", flip=False)
    # the training step failed inside the one-hot targets (index 2 out of bounds), streamed or decoded
    with pytest.raises(DataError, match=r"shards: label 2 is not one of the 2 classes its labels are read under"):
        next(iter(StreamLoader(source, 30, augment=augment, shuffle_buffer=0, workers=workers)))
    with pytest.raises(DataError, match=r"shards: shard-\d+\.tar:\d+: label 2 is not one of the 2 classes"):
        load_in_memory(str(shards), cache_dir=tmp_path / "cache", workers=1)


def test_a_multi_label_set_decoded_into_memory_to_train_on_is_refused_naming_how_to_stream_it(tmp_path):
    # decoded into memory each sample keeps its first label: a JFT-style run with --stream memory trained
    # on first labels only, where streamed it trains on every label (multi-hot targets)
    from vitlab.config import ConfigError
    from vitlab.data.labelled import load_labelled
    from vitlab.train.inputs import build_splits
    from vitlab.train.config import DataConfig, TrainConfig

    out = multi_label_shard(tmp_path / "jft", ["0,2", "1", "3,1,0", "2"] * 3)
    for cache in (None, tmp_path / "cache", tmp_path / "cache"):  # decoded, then cached, then read from the cache
        data = load_labelled(str(out), (8, 8), cache_dir=cache)
        assert data.labels.tolist() == [0, 1, 3, 2] * 3 and data.several_labels == 6  # evaluation: the first label
        cfg = TrainConfig(data=DataConfig(source=str(out), val_split=0, stream="memory",
                                          cache_dir=None if cache is None else str(cache)))
        with pytest.raises(ConfigError, match=r"data.stream='memory': .*jft: 6 sample\(s\) have several labels, of which "
                                              r"a set decoded into memory keeps the first; stream it \(data.stream='stream'\)"):
            build_splits(cfg, (8, 8))
    # a copy cached before the count was recorded is decoded again, and cached with it
    (meta,) = (tmp_path / "cache").rglob("meta.json")
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "several_labels"}))
    assert load_labelled(str(out), (8, 8), cache_dir=tmp_path / "cache").several_labels == 6
    assert json.loads(meta.read_text())["several_labels"] == 6
    # and one cached before each sample's labels were kept (label_sets.npy): they are what its evaluation scores
    (meta.parent / "label_sets.npy").unlink()
    again = load_labelled(str(out), (8, 8), cache_dir=tmp_path / "cache")
    assert again.label_sets[:4].tolist() == [[0, 2, -1], [1, -1, -1], [3, 1, 0], [2, -1, -1]]
    assert (meta.parent / "label_sets.npy").is_file()
