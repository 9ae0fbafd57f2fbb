"""A labelled set named by the user, decoded into memory: what `train` (its training set
in memory, its validation set), `eval` and `fewshot` read.

``source`` takes every form the data may come in: an ImageFolder folder or archive,
tar shards (a folder, a brace pattern ``shards/shard-{000000..000009}.tar``, a glob),
a Hugging Face ``save_to_disk`` folder, parquet files, or the built-in "digits".

``load_held_out`` is what a trained model is scored on: a set split as its training run
split it, from the data section that run recorded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from vitlab.config import ConfigError, need_count_or_fraction, need_output_folder, to_pair
from vitlab.data.digits import load_digits_dataset
from vitlab.data.memory import InMemoryDataset, load_in_memory, load_source_in_memory
from vitlab.data.sources import PathLike
from vitlab.data.splits import (check_seed, part_key, same_spelling, select_classes, split_changes, split_key, stratified_split,
                                 training_pool)
from vitlab.data.stream import hold_out, open_source, units_key

__all__ = ["load_labelled", "HeldOutSet", "load_held_out", "match_run_classes", "labels_by_name"]


def load_labelled(source: str, image_size, cache_dir: Optional[PathLike] = None, workers: Optional[int] = None,
                  held_out: Optional[tuple[float, int]] = None, training: bool = False) -> InMemoryDataset:
    """``source`` decoded at ``image_size`` (int or (H, W)); its ``key`` names the data and
    the size (what features computed from it can be cached under).

    held_out: (share, seed): only the whole units (shards) a streamed training run held out
        for validation with ``data.val_split=share`` and ``data.split_seed=seed``
        (``vitlab.data.stream.hold_out``); with ``training``, the units it trained on instead.

    Raises:
        DataError: nothing usable at ``source`` (see ``load_in_memory``).
    """
    size = to_pair(image_size, "image_size")
    if source == "digits":
        data = load_digits_dataset(size)
        data.key = f"digits@{size[0]}" if size[0] == size[1] else f"digits@{size[0]}x{size[1]}"
        return data
    if held_out is not None:
        trained, part = hold_out(open_source(source, cache_dir), *held_out)
        data = load_source_in_memory(trained if training else part, size, cache_dir, workers)
    else:
        data = load_in_memory(source, image_size=size, cache_dir=cache_dir, workers=workers)
    data.key = f"{data.key}@{size[0]}x{size[1]}"
    return data


@dataclass
class HeldOutSet:
    """A labelled set in memory and the part of it held out: what a trained model is scored on."""

    images: torch.Tensor   # uint8 (N, 3, H, W)
    labels: torch.Tensor   # int64 (N,)
    classes: list[str]
    key: str               # names the data, the size and any class subset (what features are cached under)
    skipped: int           # images left out as unreadable (the warnings name them)
    rest: torch.Tensor     # indices of the examples not held out (the few-shot pool)
    held: torch.Tensor     # indices of the held-out examples
    split: float | int     # what was held out: a count, a fraction, or 0 (everything)
    seed: int              # the seed of the split
    run_shards: bool = False  # held out: the shards a streamed run held out (``rest``: its training shards, or empty)
    val_data: Optional[str] = None  # the held-out part is the run's validation set of its own (data.val_data)
    ids: Optional[torch.Tensor] = None  # (N,) each example's name, file size and class (``InMemoryDataset.ids``)
    # a multi-label set's: (N, L) each example's labels, -1 filling a row (``InMemoryDataset.label_sets``)
    label_sets: Optional[torch.Tensor] = None

    def held_for_model(self, run_classes: Any, num_outputs: int,
                       kept: Optional[list[str]] = None) -> tuple[torch.Tensor, list[str]]:
        """The held-out examples' labels as the outputs of a model that scores them
        (``match_run_classes``), and the names of those outputs: (N,), or of a multi-label set
        (N, L), every label of each example (``label_sets``), as ``vitlab.eval.Evaluator`` scores them."""
        order = match_run_classes(self.classes, run_classes, num_outputs, kept)
        labels = (self.labels if self.label_sets is None else self.label_sets)[self.held]
        if order is None:
            return labels, self.classes
        return renumbered(order, labels), list(run_classes if isinstance(run_classes, list) else kept)

    def held_part(self) -> str:
        """What the held-out part is, in words (the few-shot summary's)."""
        if self.run_shards:
            return f"the run's held-out shards, val_split {self.split}, seed {self.seed}"
        return f"the run's data.val_data {self.val_data}" if self.val_data else f"split {self.split}, seed {self.seed}"


def load_held_out(run: Mapping[str, Any], image_size, source: Optional[str] = None,
                  val_split: Optional[float] = None, split_seed: Optional[int] = None, default_split: float = 0.0,
                  cache_dir: Optional[PathLike] = None, pool: bool = True,
                  workers: Optional[int] = None, results: Optional[Mapping[str, Any]] = None,
                  run_name: str = "the run") -> HeldOutSet:
    """``source`` (default: the run's data) at ``image_size``, split as the run split it.

    run: the data section of the config the model's training run recorded ({} without one).
    val_split, split_seed: the split (``stratified_split``: a count, a fraction, or 0 to hold
        out everything); None: the run's where ``source`` is the run's data, else
        ``default_split`` and seed 0.  The run's ``class_subset`` applies to the run's data, and
        a split of it is of the run's ``train_examples`` pool, as the run's was (the images
        are then the pool's).
    pool: whether the examples not held out are wanted; without, a streamed run's held-out
        shards are decoded alone (``hold_out``), not the whole set; with, its training shards
        are the pool (``_with_run_shards``).  The default for a run that
        validated on a set of its own (``val_data``) is that set, whole: with ``pool``, after
        the run's training examples (``_with_val_data``).
    workers: decoding processes (None: ``load_in_memory``'s default).
    results: the run's summary (``summary.json``), whose ``split_key`` (which images each part
        holds; of a run before it was recorded, ``train_examples`` and ``val_examples``: how many)
        the run's own split, re-derived (no ``val_split`` given, the run's data), must give again;
        run_name names the run where it does not (``_check_run_split``).
    cache_dir: where decoded sets are cached; None: the run's ``cache_dir`` where it recorded one that
        can be written, else ``load_in_memory``'s default.
    """
    cache_dir = cache_dir if cache_dir is not None else _run_cache_dir(run)
    if source is None and run.get("val_data") and pool and val_split is None:
        held = _with_val_data(run, image_size, split_seed, cache_dir, workers)
        _check_run_split(results, run_name, f"data {run.get('source')} and data.val_data {run['val_data']}",
                         part_key(held.ids[held.rest]), part_key(held.ids[held.held]))
        return held
    # what the run's own split, re-derived, must give again (train, val); None: no split of the run's
    expected_val_data = source is None and run.get("val_data") and val_split is None
    if source is None and run.get("val_data") and not pool:
        # its data held nothing out: scored whole by default, it was every image the run trained on
        run = {**run, "source": run["val_data"], "val_split": 0, "train_examples": 0, "stream": None}
    source = source or run.get("source")
    if not source:
        raise ValueError("--data is needed: the checkpoint's run does not name its data")
    same_as_run = bool(run) and same_data(source, run.get("source"))
    seed_given = split_seed is not None
    if split_seed is None:
        split_seed = int(run.get("split_seed", 0)) if same_as_run else 0
    # the flags are checked before the data is decoded, which can take minutes
    check_seed(split_seed, "--split-seed")
    if val_split is not None:
        _check_val_split(val_split)
    if cache_dir is not None:  # a file there was the OS's "Not a directory: '<it>/arrays'"
        need_output_folder("--cache-dir", cache_dir)
    run_shards = same_as_run and val_split is None and run.get("stream") == "stream" and bool(run.get("val_split"))
    if run_shards and pool:
        return _with_run_shards(run, source, image_size, split_seed, cache_dir, workers, results, run_name)
    asked_split = val_split
    if val_split is None and not run_shards:
        val_split = float(run["val_split"]) if same_as_run and run.get("val_split") else default_split
    # the whole set has no split to seed: a seed given for it was accepted, reported, and changed nothing
    if seed_given and val_split == 0 and not run_shards:
        unsplit = "the run held out nothing" if same_as_run else "the data is not the run's"
        why = "--val-split 0" if asked_split is not None else f"no --val-split, and {unsplit}"
        raise ValueError(f"--split-seed={split_seed}: seeds the held-out split, and the whole set is scored ({why}); "
                         "give --val-split, or leave --split-seed out")
    data = load_labelled(source, image_size, cache_dir=cache_dir, workers=workers,
                         held_out=(run["val_split"], split_seed) if run_shards else None)
    images, labels, classes, key, ids = data.images, data.labels, list(data.classes), data.key, data.ids
    if same_as_run and run.get("class_subset"):
        subset = tuple(run["class_subset"])
        ids = select_classes(ids, labels, classes, subset)[0]
        images, labels, classes = select_classes(images, labels, classes, subset)
        key += "|" + ",".join(classes)
    taken = int(run.get("train_examples") or 0) if same_as_run else 0
    if taken and val_split and not run_shards and taken < len(labels):
        # the run split its pool of data.train_examples: a split of the whole set held out other
        # examples, some of them trained on
        seed = int(run.get("split_seed", 0))
        keep = training_pool(labels, taken, seed)
        images, labels, ids = images[keep], labels[keep], ids[keep]
        key += f"|pool of {taken}, split seed {seed}"
    if run_shards:
        rest, held, split = torch.arange(0), torch.arange(len(labels)), run["val_split"]
        # the run's held-out shards, as it decoded them; its training shards as it named them, unread (units_key)
        trained = hold_out(open_source(source, cache_dir), run["val_split"], split_seed)[0]
        _check_run_split(results, run_name, f"data {source}", units_key(trained), part_key(ids))
    else:
        # named as the user knows it: the split's own name for it is val_size
        name = "--val-split" if asked_split is not None or not same_as_run else "data.val_split (the run's)"
        rest, held, split = _split(labels, val_split, split_seed, name)
        if expected_val_data:  # the run's val_data, scored whole: what it validated on
            _check_run_split(results, run_name, f"data.val_data {source}", None, part_key(ids[held]))
        elif same_as_run and asked_split is None and val_split and run.get("stream") in (None, "memory"):
            _check_run_split(results, run_name, f"data {source}", part_key(ids[rest]), part_key(ids[held]))
    # a multi-label set trains streamed, so none has a class subset or a pool of train_examples to select
    return HeldOutSet(images, labels, classes, key, data.skipped.images, rest, held, split, split_seed, run_shards,
                      ids=ids, label_sets=data.label_sets)


def _run_cache_dir(run: Mapping[str, Any]) -> Optional[str]:
    """The decoded sets' folder the run recorded (``data.cache_dir``), None where it recorded none or it cannot
    be written here (a run copied from another machine): without it, eval and fewshot decoded the run's data
    again into the default cache."""
    folder = run.get("cache_dir")
    if not folder:
        return None
    try:
        need_output_folder("data.cache_dir", folder)
    except ConfigError:
        return None
    return folder


def absolute_source(source: Optional[str]) -> Optional[str]:
    """``source`` as a run records it: a path (a file, a folder, a pattern of shards) absolute, with
    ``~`` expanded, so that a later eval, fewshot or --resume run from another folder reads the run's
    data; the built-in digits and None as they are.  Recorded as typed, ``./images`` was read in the
    folder of the later command: another set of that name there was scored as the run's held-out
    split, or the run's resumed on it."""
    if source is None or source == "digits":
        return source
    return str(Path(source).expanduser().absolute())


def _with_val_data(run: Mapping[str, Any], image_size, split_seed: Optional[int], cache_dir: Optional[PathLike],
                   workers: Optional[int]) -> HeldOutSet:
    """A run that validated on its ``val_data``: the pool is what it trained on (its data, class
    subset and ``train_examples`` pool), the held-out part its ``val_data``, whole.  A split of its
    training data held out examples it had trained on, and scored them."""
    held = load_held_out(run, image_size, None, None, split_seed, cache_dir=cache_dir, pool=False, workers=workers)
    trained = load_held_out({**run, "val_data": None}, image_size, None, 0, cache_dir=cache_dir, workers=workers)
    images, labels, key, ids = trained.images, trained.labels, trained.key, trained.ids
    taken = int(run.get("train_examples") or 0)
    if taken and taken < len(labels):  # the run's pool, as it drew it
        keep = training_pool(labels, taken, int(run.get("split_seed", 0)))
        images, labels, ids = images[keep], labels[keep], ids[keep]
        key += f"|pool of {taken}, split seed {int(run.get('split_seed', 0))}"
    held_labels = labels_by_name(held.labels, held.classes, trained.classes)  # the run's labels, by name
    if held_labels is None:  # the run refused such a val_data; a set changed since is named here
        raise ValueError(f"data.val_data={run['val_data']!r}: its classes ({', '.join(held.classes[:5])}, ...) are "
                         f"not the run's data's ({', '.join(trained.classes[:5])}, ...)")
    # a multi-label val_data: the pool's one label each, -1 filling their rows
    sets = None if held.label_sets is None else labels_by_name(held.label_sets, held.classes, trained.classes)
    label_sets = joined_label_sets([(labels, None), (held_labels, sets)])
    n = len(labels)
    return HeldOutSet(torch.cat([images, held.images]), torch.cat([labels, held_labels]), trained.classes,
                      f"{key}|val {held.key}", trained.skipped + held.skipped, torch.arange(n),
                      torch.arange(n, n + len(held.labels)), 0, held.seed, val_data=str(run["val_data"]),
                      ids=torch.cat([ids, held.ids]), label_sets=label_sets)


def _with_run_shards(run: Mapping[str, Any], source: str, image_size, split_seed: int, cache_dir: Optional[PathLike],
                     workers: Optional[int], results: Optional[Mapping[str, Any]], run_name: str) -> HeldOutSet:
    """A streamed run's split with its pool: its held-out shards scored and its training shards the pool,
    each drawn as the run drew them (``hold_out``).  A stratified split of the whole set, which is no split
    the run made, held out images of its training shards, the model's own training images, and scored them."""
    held = load_held_out(run, image_size, source, None, split_seed, cache_dir=cache_dir, pool=False, workers=workers,
                         results=results, run_name=run_name)
    trained = load_labelled(source, image_size, cache_dir=cache_dir, workers=workers,
                            held_out=(run["val_split"], split_seed), training=True)
    n = len(trained.labels)
    return HeldOutSet(torch.cat([trained.images, held.images]), torch.cat([trained.labels, held.labels]), held.classes,
                      f"{trained.key}|held out {held.key}", trained.skipped.images + held.skipped, torch.arange(n),
                      torch.arange(n, n + len(held.labels)), held.split, held.seed, run_shards=True,
                      ids=torch.cat([trained.ids, held.ids]),
                      label_sets=joined_label_sets([(trained.labels, trained.label_sets),
                                                    (held.labels, held.label_sets)]))


def joined_label_sets(parts: list) -> Optional[torch.Tensor]:
    """The (N, L) label sets of ``parts`` joined in order, each (labels (n,), label_sets (n, l) or None): a part
    of one label per image gives its labels as the first column; -1 fills every row to the widest.  None
    where no part has several labels per image."""
    if all(sets is None for _, sets in parts):
        return None
    width = max(sets.shape[1] for _, sets in parts if sets is not None)
    rows = []
    for labels, sets in parts:
        row = torch.full((len(labels), width), -1, dtype=torch.long)
        if sets is None:
            row[:, 0] = labels
        else:
            row[:, :sets.shape[1]] = sets
        rows.append(row)
    return torch.cat(rows)


def _check_run_split(results: Optional[Mapping[str, Any]], run_name: str, data: str,
                     train: Optional[str], val: Optional[str]) -> None:
    """Raises ValueError where the run's split, re-derived from its data as it is now, does not hold the
    images its summary ``results`` recorded; ``train`` and ``val``: the parts' ``part_key``s now (None: not
    compared); ``data`` names the data in words.  Such data changed since the run (a class folder gone,
    images added, an image swapped for another, shards packed again), and the split drawn from it is
    another, whose held-out part can hold images the run trained on.  A run recorded before its
    ``split_key`` was is held to its counts, ``train_examples`` and ``val_examples``, which as many
    other images pass.  No summary (a run still training): nothing to compare."""
    recorded = results.get("split_key") if isinstance(results, Mapping) else None
    if isinstance(recorded, Mapping):
        differs = split_changes(split_key(train, val), recorded)
    else:
        try:
            counts = int(results["train_examples"]), int(results["val_examples"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return
        now = [None if part is None else int(part.partition("-")[0]) for part in (train, val)]
        differs = [f"{what} {count} examples, the run's {then}" for what, count, then in
                   zip(("training", "held-out"), now, counts) if count is not None and count != then]
    if differs:
        raise ValueError(f"{run_name}: its {data} changed since it trained (now {'; '.join(differs)}): a split drawn "
                         "from it is not the run's, and can hold images the run trained on; to score it anyway, give "
                         "--data and --val-split (a split of your choosing, not the run's held-out one)")


def same_data(source, recorded) -> bool:
    """Whether ``source`` names the data a run ``recorded``: the same text, or the same path made
    absolute (``absolute_source``: a pattern of shards too), or the same file or folder (``./images``,
    its absolute path and a link to it name what ``images`` names; compared as text, such a spelling
    was taken for other data, and the whole set, the run's training images too, scored).  A run that
    recorded a relative path (before ``absolute_source``) names it in the working folder."""
    if recorded is None or source is None:
        return False
    if str(source) == str(recorded) or absolute_source(str(source)) == absolute_source(str(recorded)):
        return True
    try:
        return os.path.samefile(source, recorded)
    except (OSError, ValueError):  # either names no file: a pattern, a name such as digits
        return False


def _check_val_split(val_split: float) -> None:
    # a finite number: NaN compares false with everything, and reached the split, which named "val_size"
    need_count_or_fraction("--val-split", val_split, "a count (integer >= 1), a fraction in (0, 1), or 0 for all")


def _split(labels: torch.Tensor, val_split: float, seed: int,
           name: str = "--val-split") -> tuple[torch.Tensor, torch.Tensor, float | int]:
    """(rest, held, split): ``val_split`` examples held out (a count or a fraction), or all for 0."""
    _check_val_split(val_split)
    if val_split == 0:
        return torch.arange(0), torch.arange(len(labels)), 0
    size = int(val_split) if val_split >= 1 else float(val_split)
    return (*stratified_split(labels, size, seed, name), size)


def match_run_classes(classes: list[str], run_classes: Any, num_outputs: int,
                      kept: Optional[list[str]] = None) -> Optional[torch.Tensor]:
    """The output of a model with ``num_outputs`` outputs that scores each of the data's ``classes``,
    matched by name: (len(classes),) int64, or None where they are the outputs in order.

    run_classes: the classes its run trained on (``classes.json``; None: unknown); every class of
        the data must be one of them, in any order (a folder sorts its classes by name, a parquet
        set keeps its own order) or a subset.
    kept: otherwise the names kept with the weights (a Hugging Face ``id2label``, a timm export's
        ``label_names``): matched the same way where they name the data's classes; where they name
        none of them (ImageNet's descriptions beside folders of WordNet ids) the classes are taken
        in order, as the outputs (the names were not read, and a folder of the same names in another
        order was scored against the wrong outputs).
    Names are compared composed and decomposed alike (``same_spelling``).
    """
    names = run_classes if isinstance(run_classes, list) else kept
    ours, theirs = same_spelling(classes), same_spelling(names) if isinstance(names, list) else None
    if isinstance(names, list) and (names is run_classes or set(ours) & set(theirs)):
        missing = [c for c, same in zip(classes, ours) if same not in theirs]
        if missing:
            raise ValueError(f"the data's classes ({', '.join(missing[:5])}, ...) are not among the {len(names)} the "
                             f"checkpoint was trained on ({', '.join(map(str, names[:5]))}, ...)")
        if len(names) != num_outputs or len(set(theirs)) < len(names):
            raise ValueError(f"the checkpoint's {len(names)} class names ({len(set(names))} distinct) do not name its "
                             f"{num_outputs} outputs one each")
        return None if theirs == ours else torch.tensor([theirs.index(c) for c in ours])
    if num_outputs != len(classes):
        raise ValueError(f"the model has {num_outputs} outputs but the data has {len(classes)} classes")
    return None


def labels_by_name(labels: torch.Tensor, classes: list[str], onto: list[str]) -> Optional[torch.Tensor]:
    """``labels`` of a set whose classes are ``classes`` as the labels of the same names in ``onto``
    (a set of the same classes in another order, or of some of them: a parquet or Hub set keeps its
    own order where a folder sorts, and a folder may lack a class); None where a class of ``classes``
    is not one of ``onto`` (its images have no label there).  A multi-label set's (N, L) label sets
    keep the -1 that fills their rows."""
    classes, onto = same_spelling(classes), same_spelling(onto)
    if any(c not in onto for c in classes):
        return None
    return renumbered(torch.tensor([onto.index(c) for c in classes], dtype=torch.long), labels)


def renumbered(order: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``order[labels]``: each label's new number; the -1 that fills a multi-label set's rows stays
    (indexed, it took the last class's number)."""
    return torch.where(labels >= 0, order[labels.clamp(min=0)], labels)
