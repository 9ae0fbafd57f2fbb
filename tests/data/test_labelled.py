"""``load_held_out``: what a trained model is scored on, split as its run split it (the data
section of its recorded config, either layout, read by ``train.legacy.recorded_section``)."""

import pytest
import torch

from vitlab.data.digits import load_digits_dataset
from vitlab.data.labelled import load_held_out, match_run_classes
from vitlab.data.splits import stratified_split, training_pool
from vitlab.train.legacy import recorded_section

FLAT = {"recipe": "test", "data": "digits", "val_split": 100, "split_seed": 1, "class_subset": ["5", "3"]}
NESTED = {"recipe": "test", "data": {"source": "digits", "val_split": 100, "split_seed": 1, "class_subset": ["5", "3"]}}


def test_a_runs_record_is_read_in_either_layout():
    assert recorded_section(FLAT, "data") == recorded_section(NESTED, "data") == NESTED["data"]
    assert recorded_section(None, "data") == recorded_section({"recipe": "x"}, "data") == {}


def test_the_runs_data_is_split_as_the_run_split_it():
    data = load_held_out(recorded_section(FLAT, "data"), 8)
    assert data.classes == ["5", "3"] and data.key == "digits@8|5,3"  # the run's classes, relabelled 0, 1
    digits = load_digits_dataset(8)
    keep = (digits.labels == 5) | (digits.labels == 3)
    assert torch.equal(data.images, digits.images[keep]) and torch.equal(data.labels, (digits.labels[keep] == 3).long())
    rest, held = stratified_split(data.labels, 100, 1)
    assert torch.equal(data.rest, rest) and torch.equal(data.held, held)
    assert (data.split, data.seed, data.run_shards) == (100, 1, False)


def test_the_digits_are_resized_to_a_non_square_size_as_a_folders_images_are():
    """The digits source refused any (H, W) but a square ("makes square images only"): a non-square run
    on them, and eval or fewshot of it, could not be made."""
    import torch.nn.functional as F

    from vitlab.data.labelled import load_labelled

    data = load_labelled("digits", (16, 24))
    assert data.images.shape == (1797, 3, 16, 24) and data.key == "digits@16x24"
    stretched = F.interpolate(load_digits_dataset(8).images[:, :1].float(), size=(16, 24), mode="bilinear",
                              align_corners=False)
    # the same digits stretched (from the source's 17 grey levels, not the 8x8 uint8 images: within a level)
    assert (data.images[:, :1].float() - stretched).abs().max() <= 1
    assert load_labelled("digits", (16, 16)).key == load_labelled("digits", 16).key == "digits@16"  # as before
    assert load_held_out(recorded_section(NESTED, "data"), (16, 24)).images.shape[-2:] == (16, 24)


def test_flags_win_and_other_data_takes_the_defaults():
    run = NESTED["data"]
    everything = load_held_out(run, 8, val_split=0)
    assert (everything.split, len(everything.rest)) == (0, 0)
    assert torch.equal(everything.held, torch.arange(len(everything.labels)))
    fraction = load_held_out(run, 8, val_split=0.5)
    assert fraction.split == 0.5 and len(fraction.held) == len(fraction.labels) // 2
    other = load_held_out({**run, "source": "elsewhere"}, 8, source="digits", default_split=0.1)
    assert len(other.classes) == 10 and (other.split, other.seed) == (0.1, 0)  # not the run's data: nothing of its
    with pytest.raises(ValueError, match=r"--val-split=2.5: a count \(integer >= 1\)"):
        load_held_out(run, 8, val_split=2.5)
    with pytest.raises(ValueError, match="--data is needed"):
        load_held_out({}, 8)


def test_the_runs_data_by_another_spelling_is_split_as_the_run_split_it(tmp_path, monkeypatch):
    """--data ./images or its absolute path, where the run recorded images: taken for other data, the
    whole set was scored, the run's training images with its held-out ones."""
    from PIL import Image

    for c in range(2):
        (tmp_path / "images" / str(c)).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * i, 100 * c, 0)).save(tmp_path / "images" / str(c) / f"{i}.png")
    monkeypatch.chdir(tmp_path)
    run = {"source": "images", "val_split": 4, "split_seed": 3}
    recorded = load_held_out(run, 8, cache_dir=tmp_path / "cache")
    assert (recorded.split, recorded.seed, len(recorded.held)) == (4, 3, 4)
    for spelling in ("./images", str(tmp_path / "images"), "images/"):
        data = load_held_out(run, 8, source=spelling, cache_dir=tmp_path / "cache")
        assert (data.split, data.seed) == (4, 3) and torch.equal(data.held, recorded.held), spelling
    other = tmp_path / "other"
    other.symlink_to(tmp_path / "images")  # the same folder under another name is the same data too
    assert torch.equal(load_held_out(run, 8, source=str(other), cache_dir=tmp_path / "cache").held, recorded.held)


def test_the_runs_data_is_decoded_into_the_cache_the_run_recorded(make_folder, tmp_path, monkeypatch):
    """eval and fewshot of a run that recorded data.cache_dir, given no --cache-dir, decoded its data again
    into the default cache."""
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "default"))
    run = {"source": str(make_folder()), "val_split": 3, "cache_dir": str(tmp_path / "runs")}
    assert len(load_held_out(run, 8).held) == 3
    assert any((tmp_path / "runs").iterdir()) and not (tmp_path / "default").exists()
    load_held_out(run, 8, cache_dir=tmp_path / "given")  # the flag wins
    assert any((tmp_path / "given").iterdir()) and not (tmp_path / "default").exists()
    # a recorded folder that cannot be one here (a run copied from another machine): the default
    (tmp_path / "a-file").write_text("kept")
    assert len(load_held_out({**run, "cache_dir": str(tmp_path / "a-file" / "c")}, 8).held) == 3
    assert any((tmp_path / "default").iterdir()) and (tmp_path / "a-file").read_text() == "kept"


def test_a_run_with_a_validation_set_of_its_own_is_scored_on_it(tmp_path):
    """With data.val_data (and so no held-out split), eval without --data scored the run's training
    set, every image it had trained on, as "all examples"."""
    from PIL import Image

    for c in ("5", "3"):
        (tmp_path / "val" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "val" / c / f"{i}.png")
    run = {"source": "digits", "val_split": 0, "val_data": str(tmp_path / "val"), "class_subset": ["5", "3"]}
    data = load_held_out(run, 8, pool=False, cache_dir=tmp_path / "cache")
    assert len(data.labels) == 6 and data.classes == ["5", "3"] and data.split == 0
    assert data.labels.tolist() == [1, 1, 1, 0, 0, 0]  # the run's labels: its class_subset's order
    training = load_held_out(run, 8, source="digits", pool=False)  # asked for by name: the training set
    assert len(training.labels) == 365 and training.split == 0


def test_few_shot_of_a_run_with_a_validation_set_of_its_own_is_evaluated_on_it(tmp_path):
    """fewshot (pool=True) of a run with data.val_data evaluated on a 10% split of the run's training data,
    images it had trained on; the pool is what it trained on, its val_data is evaluated whole, as eval scores it."""
    from PIL import Image

    for c in ("5", "3"):
        (tmp_path / "val" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "val" / c / f"{i}.png")
    run = {"source": "digits", "val_split": 0, "val_data": str(tmp_path / "val"), "class_subset": ["5", "3"]}
    data = load_held_out(run, 8, default_split=0.1, cache_dir=tmp_path / "cache")
    scored = load_held_out(run, 8, pool=False, cache_dir=tmp_path / "cache")  # what eval scores
    assert len(data.rest) == 365 and len(data.held) == 6 and data.val_data == str(tmp_path / "val")
    assert torch.equal(data.images[data.held], scored.images) and torch.equal(data.labels[data.held], scored.labels)
    training = load_held_out({**run, "val_data": None}, 8, val_split=0)
    assert torch.equal(data.images[data.rest], training.images) and data.classes == ["5", "3"]
    assert "the run's data.val_data" in data.held_part() and data.key != training.key
    # of its data.train_examples pool, drawn as the run drew it
    pooled = load_held_out({**run, "train_examples": 100, "split_seed": 2}, 8, cache_dir=tmp_path / "cache")
    keep = training_pool(training.labels, 100, 2)
    assert torch.equal(pooled.images[pooled.rest], training.images[keep]) and len(pooled.held) == 6
    # a split asked for is a split of the data, as before
    assert load_held_out(run, 8, val_split=0.1).val_data is None


def test_the_flags_are_checked_before_the_data_is_decoded(monkeypatch):
    import vitlab.data.labelled as labelled

    def no_decoding(*args, **kwargs):
        raise AssertionError("the data was decoded before the flags were checked")

    monkeypatch.setattr(labelled, "load_labelled", no_decoding)
    run = NESTED["data"]
    # NaN compares false with everything: it went on to the split, which named "val_size"
    with pytest.raises(ValueError, match=r"^--val-split=nan: a count \(integer >= 1\)"):
        load_held_out(run, 8, val_split=float("nan"))
    with pytest.raises(ValueError, match=r"^--val-split=inf: a count"):
        load_held_out(run, 8, val_split=float("inf"))
    # the whole set scored has no split to seed: --split-seed was accepted, reported in the JSON, and changed nothing
    for recorded, kwargs, why in ((run, {"val_split": 0}, "--val-split 0"),
                                  ({**run, "source": "elsewhere"}, {"source": "digits"},
                                   "no --val-split, and the data is not the run's"),
                                  ({**run, "val_split": 0}, {}, "no --val-split, and the run held out nothing")):
        with pytest.raises(ValueError, match=rf"^--split-seed=4: seeds the held-out split, and the whole set is "
                                             rf"scored \({why}\); give --val-split, or leave --split-seed out$"):
            load_held_out(recorded, 8, split_seed=4, **kwargs)
    # numpy's refusal of a negative seed named neither the flag nor the value
    with pytest.raises(ValueError, match=r"^--split-seed=-1: must be an integer >= 0$"):
        load_held_out(run, 8, split_seed=-1)


def test_the_data_s_classes_are_matched_to_the_run_s_by_name():
    """A folder's classes are sorted by name; a run's may be in another order (a parquet set's own), or
    the data may hold some of them: each class is scored as the output of its name (another order
    was refused; names kept with the weights alone, a Hugging Face id2label, were not read at all)."""
    assert match_run_classes(["a", "b"], ["a", "b"], 2) is None
    assert match_run_classes(["a", "b"], None, 2) is None
    assert match_run_classes(["a", "b"], ["b", "a"], 2).tolist() == [1, 0]
    assert match_run_classes(["a", "c"], ["c", "b", "a"], 3).tolist() == [2, 0]  # a subset
    assert match_run_classes(["a", "b"], None, 2, kept=["b", "a"]).tolist() == [1, 0]
    assert match_run_classes(["n01", "n02"], None, 2, kept=["tench", "goldfish"]) is None  # another vocabulary
    with pytest.raises(ValueError, match=r"the data's classes \(d, ...\) are not among the 2 the checkpoint was "
                                         r"trained on \(b, a"):
        match_run_classes(["a", "d"], ["b", "a"], 2)
    with pytest.raises(ValueError, match=r"the data's classes \(d, ...\) are not among the 2"):
        match_run_classes(["a", "d"], None, 2, kept=["b", "a"])
    with pytest.raises(ValueError, match=r"the checkpoint's 2 class names \(1 distinct\) do not name its 2 outputs"):
        match_run_classes(["a"], None, 2, kept=["a", "a"])
    with pytest.raises(ValueError, match="the model has 3 outputs but the data has 2 classes"):
        match_run_classes(["a", "b"], None, 3)


def test_class_names_are_matched_whatever_their_unicode_normalisation():
    """The same name written composed (NFC, as most tools write it) and decomposed (NFD, as macOS's file
    systems and its zip and tar write a folder's name) was another name: a folder copied from a Mac was
    refused against its run's classes, and against names kept with the weights alone (an id2label) it
    matched none, and its classes, sorted in another order (NFD's 'e' + accent sorts before 'f', NFC's
    'é' after), were taken as the outputs in order: each scored as the other's output without a word."""
    import unicodedata

    from vitlab.data.labelled import labels_by_name

    composed = ["fig", "\u00e9t\u00e9"]                    # sorted: 'fig' < 'été'
    decomposed = sorted(unicodedata.normalize("NFD", c) for c in composed)  # 'e\u0301te\u0301' < 'fig'
    assert decomposed[0] != composed[1] and unicodedata.normalize("NFC", decomposed[0]) == composed[1]
    assert match_run_classes(decomposed, composed, 2).tolist() == [1, 0]
    assert match_run_classes(decomposed, None, 2, kept=composed).tolist() == [1, 0]
    assert match_run_classes(composed, decomposed[::-1], 2) is None
    assert labels_by_name(torch.tensor([0, 1, 1]), decomposed, composed).tolist() == [1, 0, 0]


def test_the_runs_split_of_data_changed_since_it_trained_is_refused(make_folder, tmp_path):
    """eval and fewshot of a run whose data folder lost a class (or gained images) since it trained drew
    their split from the data as it is now, without a word: another split, whose held-out part held
    images the run had trained on, scored as the run's held-out accuracy."""
    import shutil

    folder = make_folder(classes=3, per_class=6)
    run = {"source": str(folder), "val_split": 6, "stream": "memory"}
    results = {"train_examples": 12, "val_examples": 6}  # what the run's summary.json records
    cache = tmp_path / "cache"
    for pool in (False, True):  # eval's, fewshot's
        assert len(load_held_out(run, 8, cache_dir=cache, pool=pool, results=results, run_name="R").held) == 6
    shutil.rmtree(folder / "class_2")
    for pool in (False, True):
        with pytest.raises(ValueError, match=r"R: its data .* changed since it trained \(now training 6 examples, "
                                             r"the run's 12\).*--data and --val-split"):
            load_held_out(run, 8, cache_dir=cache, pool=pool, results=results, run_name="R")
    # a split asked for, other data and a run that recorded no summary are scored as asked
    assert len(load_held_out(run, 8, val_split=6, cache_dir=cache, pool=False, results=results).held) == 6
    other = make_folder(classes=2, per_class=6)
    assert len(load_held_out(run, 8, str(other), cache_dir=cache, pool=False, results=results).held) == 12
    assert len(load_held_out(run, 8, cache_dir=cache, pool=False).held) == 6
    # images added: a fraction holds out more of them
    folder = make_folder(classes=2, per_class=(6, 8))
    with pytest.raises(ValueError, match=r"now training 10 examples, the run's 9; held-out 4 examples, the run's 3"):
        load_held_out({**run, "source": str(folder), "val_split": 0.25}, 8, cache_dir=cache, pool=False,
                      results={"train_examples": 9, "val_examples": 3})


@pytest.mark.parametrize("form", ["folder", "archive"])
def test_the_runs_split_of_data_with_an_image_swapped_since_is_refused(make_folder, fakes, tmp_path, form):
    """An image swapped for another since the run trained (one gone, one of another name in its class): the
    training and held-out counts its summary recorded were the same, and eval and fewshot scored the split of
    the data as it is now, whose held-out part can hold images the run trained on, as its held-out accuracy.
    The run records which images each part holds (``split_key``: their names, file sizes and classes)."""
    from PIL import Image

    from vitlab.train.config import DataConfig, TrainConfig
    from vitlab.train.inputs import build_splits

    folder = make_folder(classes=3, per_class=6)
    source = folder if form == "folder" else fakes.make_tar(folder, tmp_path / "set.tar")
    cache = tmp_path / "cache"
    data = DataConfig(source=str(source), val_split=6, cache_dir=str(cache), decode_workers=1)
    splits = build_splits(TrainConfig(data=data), (8, 8))
    run = {"source": str(source), "val_split": 6, "stream": "memory", "split_seed": 0}
    results = {"train_examples": 12, "val_examples": 6, "split_key": splits.split_key}  # as summary.json records
    for pool in (False, True):  # eval's, fewshot's: the run's split again, read from the cache
        assert len(load_held_out(run, 8, cache_dir=cache, pool=pool, results=results, run_name="R").held) == 6
    (folder / "class_1" / "0002.png").unlink()
    Image.fromarray(fakes.image_with_id(99)).save(folder / "class_1" / "0002b.png")
    if form == "archive":
        source.unlink()
        fakes.make_tar(folder, source)
    for pool in (False, True):
        with pytest.raises(ValueError, match=r"R: its data .* changed since it trained \(now [^)]*, as many as the "
                                             r"run's but not all the same images\).*--data and --val-split"):
            load_held_out(run, 8, cache_dir=cache, pool=pool, results=results, run_name="R")
    # a run recorded before its split key is held to its counts (which the swap keeps), as it was
    old = {"train_examples": 12, "val_examples": 6}
    assert len(load_held_out(run, 8, cache_dir=cache, pool=False, results=old, run_name="R").held) == 6
    assert len(load_held_out(run, 8, val_split=6, cache_dir=cache, pool=False, results=results).held) == 6


def test_a_runs_split_key_names_its_images_wherever_the_data_lies(make_folder, fakes, tmp_path):
    """The key names the images below their class root: the run's data copied elsewhere, read from its
    archive, or decoded again (from the cache, or its copy there of an earlier version, without the names)
    gives the run's key; the parts of another split do not."""
    import shutil

    from vitlab.data.memory import load_in_memory
    from vitlab.data.splits import part_key, split_changes

    folder = make_folder(classes=3, per_class=6, subdir="train")
    copy = shutil.copytree(folder, tmp_path / "elsewhere")
    archive = fakes.make_tar(folder, tmp_path / "set.tar.gz")
    keys = {part_key(load_in_memory(where, cache_dir=tmp_path / "cache", workers=1).ids)
            for where in (folder, copy, archive, folder)}
    (cached,) = [f for f in (tmp_path / "cache" / "arrays").iterdir() if f.name.startswith("folder")]
    (cached / "ids.npy").unlink()
    keys.add(part_key(load_in_memory(folder, cache_dir=tmp_path / "cache", workers=1).ids))
    assert len(keys) == 1 and (cached / "ids.npy").is_file() and keys.pop().startswith("18-")
    ids = load_in_memory(folder, cache_dir=tmp_path / "cache", workers=1).ids
    assert part_key(ids[:6]) == part_key(ids[:6].flip(0)) != part_key(ids[1:7])  # the same images in any order
    assert split_changes({"train": part_key(ids[1:7]), "held_out": None}, {"train": part_key(ids[:6])}) == [
        "training 6 examples, as many as the run's but not all the same images"]


def test_a_runs_validation_set_changed_since_it_trained_is_refused(tmp_path):
    """The held-out part of a run with data.val_data is that set, whole: grown since, it is not what the
    run validated on."""
    from PIL import Image

    for c in ("5", "3"):
        (tmp_path / "val" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "val" / c / f"{i}.png")
    run = {"source": "digits", "val_split": 0, "val_data": str(tmp_path / "val"), "class_subset": ["5", "3"]}
    results, cache = {"train_examples": 365, "val_examples": 6}, tmp_path / "cache"
    assert len(load_held_out(run, 8, pool=False, cache_dir=cache, results=results).held) == 6
    assert len(load_held_out(run, 8, cache_dir=cache, results=results).held) == 6
    Image.new("RGB", (8, 8), (0, 40, 0)).save(tmp_path / "val" / "5" / "9.png")
    with pytest.raises(ValueError, match=r"its data.val_data .*val changed since it trained \(now held-out 7"):
        load_held_out(run, 8, pool=False, cache_dir=cache, results=results)
    with pytest.raises(ValueError, match=r"and data.val_data .*val changed since it trained \(now held-out 7"):
        load_held_out(run, 8, cache_dir=cache, results=results)
    assert len(load_held_out(run, 8, val_split=0, pool=False, cache_dir=cache, results=results).held) == 7


def test_joined_label_sets_pad_each_part_to_the_widest_and_keep_one_label_parts_as_their_first_column():
    import torch

    from vitlab.data.labelled import joined_label_sets

    one = torch.tensor([2, 0])
    several = torch.tensor([[1, 3, -1], [0, -1, -1]])
    assert joined_label_sets([(one, None), (torch.tensor([5]), None)]) is None
    joined = joined_label_sets([(one, None), (several[:, 0], several)])
    assert joined.tolist() == [[2, -1, -1], [0, -1, -1], [1, 3, -1], [0, -1, -1]]
