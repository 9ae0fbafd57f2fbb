import torch

from vitlab.data.labelled import load_held_out
from vitlab.train.config import DataConfig, TrainConfig
from vitlab.train.inputs import build_splits


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
