import shutil

import torch

from vitlab.data.labelled import load_held_out
from vitlab.train.config import DataConfig, TrainConfig
from vitlab.train.inputs import build_splits
from vitlab.train.overrides import with_changes


def test_vtab_style_pool_then_split():
    s = build_splits(TrainConfig(data=DataConfig(source="digits", train_examples=1000, val_split=200)), (8, 8))
    assert len(s.train_labels) == 800 and len(s.val_labels) == 200
    counts = torch.bincount(s.val_labels)
    assert len(counts) == 10 and counts.max() - counts.min() <= 2  # stratified (digits: 174-183 per class)
    assert s.skipped == 0 and s.classes == [str(i) for i in range(10)]



def test_a_training_pool_keeps_a_class_of_few_images_whole(tmp_path):
    from PIL import Image

    for name, count in (("many", 10), ("one", 1)):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "data" / name / f"{i}.png")
    data = DataConfig(source=str(tmp_path / "data"), train_examples=6, cache_dir=str(tmp_path / "cache"),
                      decode_workers=1)
    # the one image was its share of the pool, refused as a validation split that left it none to train on
    s = build_splits(TrainConfig(data=data), (8, 8))
    assert sorted(s.train_labels.tolist()) == [0] * 5 + [1] and s.classes == ["many", "one"]

def test_class_subset_relabels_in_the_given_order():
    s = build_splits(TrainConfig(data=DataConfig(source="digits", class_subset=("7", "3"))), (8, 8))
    assert s.classes == ["7", "3"] and set(s.train_labels.tolist()) == {0, 1}
    assert s.val_labels is None


def test_the_wait_for_batches_is_the_time_spent_in_next_and_counted_once():
    from vitlab.train.inputs import WaitTimed

    now = [0.0]  # a clock of the test's (seconds): only what the test says takes time

    def slow():
        while True:
            now[0] += 0.25  # each batch a quarter of a second in coming
            yield 1

    batches = WaitTimed(slow(), torch.device("cpu"), clock=lambda: now[0])
    for _ in range(3):
        next(batches)
        now[0] += 0.5  # the step's own time is not a wait
    assert batches.take() == 3 * 0.25
    assert batches.take() == 0.0  # taken once



def test_a_run_of_a_training_pool_is_scored_on_its_own_held_out_split():
    """A run with data.train_examples held its validation set out of that pool (VTAB-1k's 200 of
    1000): the split is of the same pool, not of the whole set, whose split held out other
    examples, some of them trained on."""
    run = {"source": "digits", "val_split": 50, "split_seed": 3, "train_examples": 300, "class_subset": ["5", "3"]}
    splits = build_splits(TrainConfig(data=DataConfig(**{**run, "class_subset": ("5", "3")})), (8, 8))
    data = load_held_out(run, 8)  # the data section as config.json records it
    assert len(data.labels) == 300 and len(data.held) == 50 and len(data.rest) == 250
    assert torch.equal(data.images[data.held], splits.val_images) and torch.equal(data.labels[data.held],
                                                                                  splits.val_labels)
    assert torch.equal(data.images[data.rest], splits.train_images)
    assert data.key == "digits@8|5,3|pool of 300, split seed 3"
    assert len(load_held_out(run, 8, val_split=0).labels) > 300  # the whole set, scored whole


def _class_images(root, classes, per_class=3):
    """A folder of 8x8 PNGs whose red channel is 40 times the index of their class in ``sorted(classes)``."""
    from PIL import Image

    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * sorted(classes).index(name), i, 0)).save(root / name / f"{i}.png")
    return root


def _shards_of(root, samples, classes):
    """One shard of (red, label) samples, its classes.txt listing ``classes`` in that (label) order."""
    import io
    import tarfile

    from PIL import Image

    root.mkdir()
    with tarfile.open(root / "shard-000000.tar", "w") as tar:
        for key, (red, label) in enumerate(samples):
            image = io.BytesIO()
            Image.new("RGB", (8, 8), (red, 0, 0)).save(image, format="PNG")
            for name, data in ((f"{key:04d}.png", image.getvalue()), (f"{key:04d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (root / "classes.txt").write_text("\n".join(classes) + "\n")
    return root


def test_a_validation_set_is_labelled_by_its_class_names(tmp_path):
    """data.val_data's classes in another order (a shard, parquet or Hub set keeps its own, a folder
    sorts) or some of them (a folder lacking one) were refused, and were what eval scores by name:
    its labels are now the training set's of the same names."""
    import pytest

    from vitlab.config import ConfigError

    train = _class_images(tmp_path / "train", ["a", "b", "c"])  # red 0, 40, 80: labels 0, 1, 2
    lacking = tmp_path / "lacking"  # the training set's a and c, its own labels 0 and 1
    for name in ("a", "c"):
        shutil.copytree(train / name, lacking / name)
    reordered = _shards_of(tmp_path / "reordered", [(80, 0), (0, 1), (40, 2)], ["c", "a", "b"])

    def splits(val_data):
        data = DataConfig(source=str(train), val_data=str(val_data), cache_dir=str(tmp_path / "cache"),
                          decode_workers=1)
        return build_splits(TrainConfig(data=data), (8, 8))

    for val_data in (lacking, reordered):
        s = splits(val_data)
        assert s.classes == ["a", "b", "c"]
        # each image labelled as its class is in the training set: red 40 * label
        assert (s.val_images[:, 0, 0, 0].long() == 40 * s.val_labels).all(), val_data
        # and so eval and fewshot of the run take it (the run's val_data, scored whole)
        run = {"source": str(train), "val_data": str(val_data), "val_split": 0}
        held = load_held_out(run, (8, 8), cache_dir=tmp_path / "cache", workers=1)
        assert held.classes == ["a", "b", "c"] and len(held.held) == len(s.val_labels)
        assert (held.images[:, 0, 0, 0].long() == 40 * held.labels).all(), val_data
    extra = _class_images(tmp_path / "extra", ["a", "b", "c", "d"])
    with pytest.raises(ConfigError, match=r"^data.val_data='.*extra': its classes are not the training set's, "
                                          r"it adds 'd'; each of its classes must be one of the training set's"):
        splits(extra)


def test_a_multi_label_validation_set_keeps_every_label_of_each_image_by_name(tmp_path):
    """A JFT-style data.val_data was labelled by each image's first label alone (scored so, a top-1 class
    that was another of its labels counted as an error); its label sets are the training set's names'
    labels, -1 filling a row, in training and in eval of the run."""
    import pytest

    from helpers.multi_label import multi_label_shard
    from vitlab.config import ConfigError

    train = _class_images(tmp_path / "train", ["a", "b", "c", "d"])
    val = multi_label_shard(tmp_path / "val", ["0,2", "1", "3,1,0"])
    (val / "classes.txt").write_text("d\nc\nb\na\n")  # its own order: its label 0 is the training set's 3
    expected = [[3, 1, -1], [2, -1, -1], [0, 2, 3]]
    data = DataConfig(source=str(train), val_data=str(val), cache_dir=str(tmp_path / "cache"), decode_workers=1)
    assert build_splits(TrainConfig(data=data), (8, 8)).val_labels.tolist() == expected
    held = load_held_out({"source": str(train), "val_data": str(val), "val_split": 0}, (8, 8),
                         cache_dir=tmp_path / "cache", workers=1)
    assert held.held_for_model(["a", "b", "c", "d"], 4)[0].tolist() == expected
    assert held.label_sets[held.rest].tolist() == [[label, -1, -1] for label in held.labels[held.rest].tolist()]
    # a class subset selects images by their one label: refused, not scored by the first
    with pytest.raises(ConfigError, match=r"^data.val_data='.*val': 2 of its images have several labels, and "
                                          r"data.class_subset=\('a', 'b'\) selects images by their one class"):
        build_splits(TrainConfig(data=DataConfig(source=str(train), val_data=str(val), class_subset=("a", "b"),
                                                 cache_dir=str(tmp_path / "cache"), decode_workers=1)), (8, 8))


def test_a_class_subset_names_its_classes_in_either_unicode_spelling(tmp_path):
    """A data folder copied from a Mac names its classes decomposed (NFD: macOS's file systems, zip and
    tar write them so), a class subset typed (and recorded by the run) composed: the same names, as class
    names are compared everywhere else (``same_spelling``), but the training run refused them as no
    such classes, a validation set of the same folders was matched class by class instead (refused for
    its classes outside the subset), and eval of a run that recorded the subset refused its data."""
    import unicodedata

    cafe = "caf\u00e9"
    folders = [unicodedata.normalize("NFD", cafe), "tea", "water"]  # sorted: 'cafe\u0301' < 'tea'
    train, val = _class_images(tmp_path / "train", folders), _class_images(tmp_path / "val", folders)
    subset = ("tea", cafe)
    common = dict(source=str(train), class_subset=subset, cache_dir=str(tmp_path / "cache"), decode_workers=1)
    s = build_splits(TrainConfig(data=DataConfig(**common, val_split=0)), (8, 8))
    assert s.classes == ["tea", cafe]
    # the red channel is 40 x the class's place among the folders: 'cafe\u0301' 0, 'tea' 40
    red = {0: 40, 1: 0}
    assert [int(image[0, 0, 0]) for image in s.train_images] == [red[int(y)] for y in s.train_labels]
    assert sorted(s.train_labels.tolist()) == [0, 0, 0, 1, 1, 1]
    s = build_splits(TrainConfig(data=DataConfig(**common, val_split=0, val_data=str(val))), (8, 8))
    assert [int(image[0, 0, 0]) for image in s.val_images] == [red[int(y)] for y in s.val_labels]
    assert sorted(s.val_labels.tolist()) == [0, 0, 0, 1, 1, 1]
    held = load_held_out({"source": str(train), "val_split": 0, "class_subset": list(subset)}, (8, 8),
                         cache_dir=tmp_path / "cache", workers=1)
    assert sorted(held.labels[held.held].tolist()) == [0, 0, 0, 1, 1, 1]


def test_each_training_image_keeps_its_stored_size_for_the_crop(tmp_path, tiny):
    """The training set held in memory is stretched to the training size; each image's stored size goes with
    it through the class subset, the training pool and the held-out split to the batches' crop (the
    loader's ``stored_sizes``), which draws its boxes in that image's geometry."""
    from PIL import Image

    from vitlab.train.build import build

    sizes = {}  # each image, a solid colour (exact once resized), by its stored (height, width)
    for c, name in enumerate(["a", "b", "c"]):
        (tmp_path / "set" / name).mkdir(parents=True)
        for i in range(12):
            colour = 12 * c + i
            sizes[colour] = (9 + i, 30 - i + c)
            Image.new("RGB", sizes[colour][::-1], (colour, 0, 0)).save(tmp_path / "set" / name / f"{i}.png")
    data = DataConfig(source=str(tmp_path / "set"), class_subset=("c", "a"), train_examples=20, val_split=6,
                      cache_dir=str(tmp_path / "cache"), decode_workers=1)
    s = build_splits(TrainConfig(data=data), (8, 8))
    assert len(s.train_labels) == 14
    assert s.train_sizes.tolist() == [list(sizes[int(red)]) for red in s.train_images[:, 0, 0, 0]]
    setup = build(with_changes(tiny(), {"data.source": str(tmp_path / "set"), "data.val_split": 6,
                                        "data.cache_dir": str(tmp_path / "cache"), "augment.crop": "inception",
                                        "optim.batch_size": 10}))
    assert setup.stream.stored_sizes.tolist() == [list(sizes[int(red)]) for red in setup.stream.images[:, 0, 0, 0]]
