"""The training run's data: decoded into RAM, class-subset, subsampled, split.

Training reads batches from an in-memory uint8 tensor (``vitlab.data.BatchStream``),
which suits the paper's transfer data sets (CIFAR, Pets, Flowers, VTAB-1k) and the
small experiments here.  Data larger than memory (tar shards, Hugging Face datasets,
parquet files, large ImageFolders) is streamed instead: ``resolve.streams`` decides
(with the data's other "auto" values, once, for the run), ``stream_splits`` opens it
(holding out whole shards for validation) and ``vitlab.data.stream.StreamLoader`` reads it
in DataLoader workers.  Validation sets are decoded into memory.
"""
from __future__ import annotations

import functools
import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from vitlab.config import ConfigError, Pair
from vitlab.data.labelled import labels_by_name, load_labelled
from vitlab.data.memory import load_source_in_memory
from vitlab.data.sources import DataError
from vitlab.data.splits import part_key, same_spelling, select_classes, split_key, stratified_split, training_pool
from vitlab.data.stream import hold_out, open_source, source_state, units_key

from .config import TrainConfig
from .distributed import barrier
from .legacy import recorded_section

log = logging.getLogger(__name__)


@dataclass
class Splits:
    """Training and validation images (N, 3, H, W) uint8 with int64 labels (a streamed
    training set: its source and size instead); a multi-label validation set's labels are (N, L),
    every label of each image, -1 filling a row (``vitlab.eval.Evaluator`` scores them by prec@1)."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor | None
    val_labels: torch.Tensor | None
    classes: list[str]
    skipped: int  # images left out of the decoded sets as unreadable (a streamed set's: its ``StreamLoader``'s)
    num_train: int | None = None  # a streamed training set's size (its images are not in memory)
    source: object = None         # a streamed run's ``vitlab.data.stream.StreamSource``
    # each training example's index in the decoded data set (class folders sorted, files
    # sorted, unreadable ones left out): what an error about an example names
    train_ids: torch.Tensor | None = None
    # which images each part holds (``vitlab.data.splits.split_key``): what the summary and the checkpoints
    # record, and eval, fewshot and --resume hold the data to
    split_key: dict | None = None
    # (N, 2) each training image's (height, width) as stored, before it was resized into memory
    # (``InMemoryDataset.sizes``): what its inception crop's geometry is of; None: unknown, or streamed
    train_sizes: torch.Tensor | None = None

    def train_count(self) -> int:
        return self.num_train if self.num_train is not None else len(self.train_labels)


def load_dataset(cfg: TrainConfig, image_size: Pair):
    """The whole labelled set as an ``InMemoryDataset``, resized to ``image_size``."""
    return load_labelled(cfg.data.source, image_size, cfg.data.cache_dir, cfg.data.decode_workers)


def build_splits(cfg: TrainConfig, image_size: Pair, world=None) -> Splits:
    """The training set decoded into memory, and its validation set: a held-out split of
    it or ``data.val_data``."""
    dataset, data = load_dataset(cfg, image_size), cfg.data
    if dataset.several_labels:  # streamed, they train as multi-hot targets
        raise ConfigError(f"data.stream='memory': {data.source}: {dataset.several_labels} sample(s) have several "
                          "labels, of which a set decoded into memory keeps the first; stream it "
                          "(data.stream='stream') to train on every label")
    ids, labels, classes, val_ids, val_labels = drawn_parts(dataset, data.class_subset, data.train_examples,
                                                            data.val_split, data.split_seed)
    # the whole set where the run trains on all of it: an index would copy every image
    images = dataset.images if len(ids) == len(dataset.labels) else dataset.images[ids]
    val_images = val_key = None
    skipped = dataset.skipped.images
    if val_ids is not None:
        val_images, val_key = dataset.images[val_ids], part_key(dataset.ids[val_ids])
        check_init_held_out(cfg, dataset, val_ids)
    if data.val_data:
        val_images, val_labels, val_skipped, val_key = load_val_data(cfg, image_size, classes, world)
        skipped += val_skipped
    return Splits(images, labels, val_images, val_labels, classes, skipped, train_ids=ids,
                  split_key=split_key(part_key(dataset.ids[ids]), val_key),
                  train_sizes=None if dataset.sizes is None else dataset.sizes[ids])


def check_init_held_out(cfg: TrainConfig, dataset, held_out: torch.Tensor) -> None:
    """Warn where ``model.init`` is a run that trained on some of the images this run holds out (``held_out``:
    their indices in ``dataset``): a fine-tune on the data of its pre-training (masked patch prediction's, then
    the labels) scored images its init had seen.  The init's training images are its recorded split of
    ``dataset`` drawn again, and counted only where they are its run's (its summary's ``split_key``)."""
    if cfg.model.init is None or not Path(cfg.model.init).expanduser().exists():
        return
    init = Path(cfg.model.init).expanduser()
    folder = init if init.is_dir() else init.parent
    try:
        data = recorded_section(json.loads((folder / "config.json").read_text()), "data")
        key = json.loads((folder / "summary.json").read_text())["split_key"]["train"]
        trained = recorded_training_part(dataset, data)
    except (OSError, ValueError, KeyError, TypeError, ConfigError, DataError):  # no run's records, or not of this data
        return
    if trained is None or part_key(dataset.ids[trained]) != key:
        return
    seen = int(torch.isin(held_out, trained).sum())
    if seen:
        warnings.warn(f"model.init={cfg.model.init!r}: its run trained on {seen} of the {len(held_out)} images this "
                      "run holds out (data.val_split), so they are not images it never saw; its run held out "
                      f"data.val_split={data.get('val_split')!r} of data.split_seed={data.get('split_seed', 0)!r}",
                      UserWarning, stacklevel=2)


def recorded_training_part(dataset, data: dict) -> torch.Tensor | None:
    """The indices in ``dataset`` of the images a run of the recorded ``data`` section trained on, drawn as
    ``build_splits`` draws them (None: a streamed run's, whose draw is another)."""
    if data.get("stream") == "stream":
        return None
    return drawn_parts(dataset, data.get("class_subset"), data.get("train_examples"), data.get("val_split"),
                       data.get("split_seed", 0))[0]


def drawn_parts(dataset, class_subset, train_examples, val_split, seed: int) -> tuple:
    """A run's parts of the set decoded into memory, as indices into ``dataset``: (training ids, their labels,
    the classes, held-out ids, their labels), the held-out ones None where ``val_split`` holds none out.  The
    classes of ``class_subset`` (relabelled in its order), a class-stratified pool of ``train_examples``, then
    a stratified split of ``val_split`` of it (VTAB-1k's 800 + 200 of 1000), each drawn with ``seed``."""
    ids, labels, classes = torch.arange(len(dataset.labels)), dataset.labels, list(dataset.classes)
    if class_subset:
        ids, labels, classes = select_classes(ids, labels, classes, tuple(class_subset))
    if train_examples and train_examples < len(labels):
        # the training pool: a class-stratified sample (the held-out part of a stratified split)
        keep = training_pool(labels, train_examples, seed)
        ids, labels = ids[keep], labels[keep]
    if not val_split:
        return ids, labels, classes, None, None
    size = int(val_split) if val_split >= 1 else float(val_split)
    train_idx, val_idx = stratified_split(labels, size, seed, "data.val_split")
    return ids[train_idx], labels[train_idx], classes, ids[val_idx], labels[val_idx]


def opened_source(source: str, cache_dir=None):
    """``vitlab.data.stream.open_source`` once per process while the source is unchanged
    (``source_state``): resolving a run counts its shards, and its loader then reads the
    same index."""
    return _opened_source(source, cache_dir, source_state(source))


@functools.lru_cache(maxsize=8)
def _opened_source(source: str, cache_dir, state: tuple):
    return open_source(source, cache_dir)


def count_images(source: str, cache_dir=None) -> int:
    """The images of a data source, counted without decoding one: the digits' count, a
    streamed source's samples, a folder's images, an archive's images (one pass over its
    headers; nothing extracted), each as its listing finds them.  Counted once per process while the source is
    unchanged (``source_state``)."""
    return _count_images(source, cache_dir, source_state(source))


@functools.lru_cache(maxsize=8)
def _count_images(source: str, cache_dir, state: tuple) -> int:
    from vitlab.data.digits import NUM_DIGITS
    from vitlab.data.sources import count_archive_images, is_archive
    from vitlab.data.stream import is_stream_source, scan_folder

    if source == "digits":
        return NUM_DIGITS
    if is_stream_source(source):
        return opened_source(source, cache_dir).num_samples
    path = Path(source).expanduser()
    if path.is_file() and is_archive(path):
        return count_archive_images(path)  # an archive that cannot be read: the reader's DataError
    return len(scan_folder(source, cache_dir))


@dataclass(frozen=True)
class HeldImages:
    """The decoded uint8 images a run holds in memory (counts, before any is decoded)."""

    train: int    # the training set held in memory (0 when streamed)
    val: int      # the validation set
    decoded: int  # the whole set as decoded, before the split (what decoding holds twice)
    copies: int = 1           # copies the process keeps (the digits: its cache too)
    from_source: bool = False  # decoded from its files in this run (not read from the cache)


def held_images(cfg: TrainConfig, streamed: bool, image_size: Pair | None = None) -> HeldImages:
    """How many images ``cfg``'s run holds in memory, counted from its sources; with
    ``image_size``, whether the run decodes them (else reads them from the cache)."""
    from vitlab.data.memory import is_decoded

    data = cfg.data
    if streamed and not data.val_data:  # held-out shards: their part of the source, decoded in this run
        from_source = image_size is not None
    else:
        decoded = data.val_data if streamed else data.source
        from_source = (image_size is not None and decoded != "digits"
                       and not is_decoded(decoded, image_size, data.cache_dir))
    total = count_images(data.source, data.cache_dir)
    if data.train_examples:
        total = min(total, data.train_examples)
    split = data.val_split
    val = 0 if not split else int(split) if split >= 1 else int(round(split * total))
    val = min(val, total)
    if data.val_data:
        val = count_images(data.val_data, data.cache_dir)
        return HeldImages(train=0 if streamed else total, val=val, decoded=max(0 if streamed else total, val),
                          copies=2 if data.source == "digits" else 1, from_source=from_source)
    if streamed:
        return HeldImages(train=0, val=val, decoded=val, from_source=from_source)
    return HeldImages(train=total - val, val=val, decoded=total, copies=2 if data.source == "digits" else 1,
                      from_source=from_source)


def stream_splits(cfg: TrainConfig, image_size: Pair, world=None) -> Splits:
    """A streamed training set: its classes and size, and ``data.val_split``'s whole units
    held out (``vitlab.data.stream.hold_out``) and decoded into memory for validation."""
    data = cfg.data
    for name, value in (("train_examples", data.train_examples), ("class_subset", data.class_subset)):
        if value:
            raise ConfigError(f"data.{name}={value!r}: a streamed training set has none here; set it to 0 or () "
                              "or decode the data into memory (data.stream='memory')")
    source = opened_source(data.source, data.cache_dir)
    val_images = val_labels = val_key = None
    skipped = 0  # of the validation set: the training set's are counted as its readers meet them
    if data.val_split:
        source, held = hold_out(source, data.val_split, data.split_seed)
        decoded_gb = held.num_samples * 3 * image_size[0] * image_size[1] / 1e9
        if decoded_gb > data.memory_limit_gb:
            raise ConfigError(f"data.val_split={data.val_split!r}: the held-out shards decode to {decoded_gb:.1f} GB, "
                              f"more than data.memory_limit_gb={data.memory_limit_gb}; hold out less or raise it")
        log.info("%s: %d of %d units (%d examples) held out for validation", data.source, len(held.units),
                 len(held.units) + len(source.units), held.num_samples)
        val = decoded_once(lambda: load_source_in_memory(held, image_size, data.cache_dir, data.decode_workers),
                           world)
        val_images, val_labels, skipped, val_key = (val.images, val.scored_labels(), val.skipped.images,
                                                    part_key(val.ids))
    if data.val_data:
        val_images, val_labels, skipped, val_key = load_val_data(cfg, image_size, list(source.classes), world)
    # the training shards are named by what names them without a read (``units_key``: listing their images
    # would read every shard; the held-out part is decoded, and names its images for free)
    return Splits(None, None, val_images, val_labels, list(source.classes), skipped, num_train=source.num_samples,
                  source=source, split_key=split_key(units_key(source), val_key))


def load_val_data(cfg: TrainConfig, image_size: Pair, classes: list[str], world=None) -> tuple:
    """(images, labels, images left out as unreadable, its images' ``part_key``) of ``data.val_data``
    decoded into memory at ``image_size``; its class names must be the training set's.  A multi-label
    set's labels are (N, L), every label of each image (``InMemoryDataset.scored_labels``)."""
    data = cfg.data
    val = decoded_once(lambda: load_labelled(data.val_data, image_size, data.cache_dir, data.decode_workers), world)
    if data.class_subset and set(same_spelling(list(data.class_subset))) <= set(same_spelling(list(val.classes))):
        if val.label_sets is not None:  # an image may hold classes of the subset and others
            raise ConfigError(f"data.val_data={data.val_data!r}: {val.several_labels} of its images have several "
                              f"labels, and data.class_subset={data.class_subset!r} selects images by their one "
                              "class; validate on a set of one label per image, or leave the class subset out")
        subset = tuple(data.class_subset)
        return (*select_classes(val.images, val.labels, list(val.classes), subset)[:2], val.skipped.images,
                part_key(select_classes(val.ids, val.labels, list(val.classes), subset)[0]))
    # matched by name: a label is a class's place in its own set's list, which may hold the same classes in
    # another order (a parquet or Hub set's own, a folder's sorted) or some of them (eval scores such a set so)
    labels = labels_by_name(val.scored_labels(), list(val.classes), list(classes))
    if labels is None:
        raise ConfigError(f"data.val_data={data.val_data!r}: its classes are not the training set's, "
                          f"{class_difference(list(val.classes), list(classes))}; each of its classes must be one "
                          "of the training set's")
    return val.images, labels, val.skipped.images, part_key(val.ids)


def class_difference(theirs: list[str], ours: list[str]) -> str:
    """How the class list ``theirs`` differs from ``ours``, in words: the names one lacks or adds,
    else the first place where the same names stand in another order."""
    def named(names: list[str]) -> str:
        return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    missing, extra = [c for c in ours if c not in set(theirs)], [c for c in theirs if c not in set(ours)]
    if missing or extra:
        return "; ".join(part for part in (missing and f"it lacks {named(missing)}",
                                           extra and f"it adds {named(extra)}") if part)
    place = next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)
    return f"the same {len(ours)} names in another order (class {place} is {theirs[place]!r}, not {ours[place]!r})"


def decoded_once(load, world=None):
    """``load()``, a decoding into the cache: under torch.distributed rank 0 decodes first
    and the other ranks then read what it cached."""
    main = world is None or world.is_main
    if not main:
        barrier(world)
    dataset = load()
    if main and world is not None and world.size > 1:
        barrier(world)
    return dataset


class Spans:
    """Spans of time on the clock that sees a step's work: the host's on a CPU; on a GPU, whose
    host runs ahead of it, events on the device's stream, so that a span is the time the
    device saw between its two marks.  ``clock``: the host's (seconds)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.monotonic) -> None:
        self.on_gpu, self.clock = torch.device(device).type == "cuda", clock
        self.marks: list = []  # (start, end) of each span not yet counted

    def mark(self):
        """Now, on the host's clock or the device's stream: a span's start."""
        if not self.on_gpu:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def close(self, start) -> None:
        """The span from ``start`` (a ``mark``) to now."""
        self.marks.append((start, self.mark()))

    def take(self) -> float:
        """The seconds of the spans closed since the last call; on a GPU call it once the device
        has done the work since (after a read of its numbers), else their events are not done."""
        if self.on_gpu:
            seconds = sum(start.elapsed_time(end) for start, end in self.marks) / 1e3
        else:
            seconds = sum(end - start for start, end in self.marks)
        self.marks.clear()
        return seconds


class WaitTimed:
    """An iterator of batches that counts how long the steps waited for them: the data
    path's share of a step (``data_wait`` in the training log).

    On a CPU the step runs on the host, so the wait is the host's time in ``next``.  On a
    GPU the host runs ahead of the device and its time in ``next`` is a wait only where the
    device sat idle meanwhile (time the host spends blocked on a full launch queue is
    not): events on the device's stream around ``next`` (``Spans``) time the gap the device
    saw between the step before and the batch being ready.  ``clock``: the host's (``Spans``)."""

    def __init__(self, batches: Iterator, device: torch.device, clock: Callable[[], float] = time.monotonic) -> None:
        self.batches, self.waits = batches, Spans(device, clock)

    def __iter__(self) -> "WaitTimed":
        return self

    def __next__(self):
        start = self.waits.mark()
        try:
            return next(self.batches)
        finally:
            self.waits.close(start)

    def take(self) -> float:
        """The seconds waited since the last call (``Spans.take``: on a GPU once the device
        has done the steps since)."""
        return self.waits.take()


WHITEN_SAMPLE = 5000  # images whose patches estimate the covariance (48x48 for 4x4 RGB patches)


def whitening_sample(splits: Splits, cfg: TrainConfig, image_size: Pair) -> torch.Tensor:
    """``model.patch_init="whiten"``'s images, float as the model reads them: ``WHITEN_SAMPLE``
    training images drawn by the run's seed (all of them when fewer).  A streamed training set
    gives the images of whole units (shards) drawn by the seed, decoded at ``image_size``."""
    from vitlab.data.transforms import to_float

    images = splits.train_images
    if images is None:
        images = streamed_sample(splits.source, WHITEN_SAMPLE, cfg, image_size)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    sample = torch.randperm(len(images), generator=generator)[:WHITEN_SAMPLE]
    return to_float(images[sample])


def streamed_sample(source, count: int, cfg: TrainConfig, image_size: Pair) -> torch.Tensor:
    """uint8 images of whole units of a streamed ``source`` holding at least ``count`` samples
    (all of it when smaller), drawn by the run's seed and decoded at ``image_size``."""
    try:
        _, source = hold_out(source, count, cfg.run.seed)
    except DataError:  # it would take every unit
        pass
    return load_source_in_memory(source, image_size, cfg.data.cache_dir, cfg.data.decode_workers).images
