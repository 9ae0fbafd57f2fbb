"""The training run's data: decoded into RAM, class-subset, subsampled, split.

Training reads batches from an in-memory uint8 tensor (``vitlab.data.BatchStream``),
which suits the paper's transfer data sets (CIFAR, Pets, Flowers, VTAB-1k) and the
small experiments here.  Data larger than memory (tar shards, brace patterns, large
ImageFolders) is streamed instead: ``streams`` decides, ``stream_splits`` opens it and
``vitlab.data.stream.StreamLoader`` reads it in DataLoader workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vitlab.config import ConfigError, Pair
from vitlab.data.splits import stratified_split

from .config import TrainConfig


@dataclass
class Splits:
    """Training and validation images (N, 3, H, W) uint8 with int64 labels."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor | None
    val_labels: torch.Tensor | None
    classes: list[str]
    skipped: int  # unreadable images left out while decoding
    num_train: int | None = None  # a streamed training set's size (its images are not in memory)
    source: object = None         # a streamed run's ``vitlab.data.stream.StreamSource``
    # each training example's index in the decoded data set (class folders sorted, files
    # sorted, unreadable ones left out): what an error about an example names
    train_ids: torch.Tensor | None = None

    def train_count(self) -> int:
        return self.num_train if self.num_train is not None else len(self.train_labels)


def load_dataset(cfg: TrainConfig, image_size: Pair):
    """The whole labelled set as an ``InMemoryDataset``, resized to ``image_size``."""
    data = cfg.data
    if data.source == "digits":
        from vitlab.data.digits import load_digits_dataset

        if image_size[0] != image_size[1]:
            raise ConfigError(f"model.img_size={image_size}: the digits source makes square images only")
        return load_digits_dataset(image_size[0])
    from vitlab.data.memory import load_in_memory

    return load_in_memory(data.source, image_size=image_size, cache_dir=data.cache_dir, workers=data.decode_workers)


def select_classes(images: torch.Tensor, labels: torch.Tensor, classes: list[str], keep: tuple[str, ...]):
    """Only the classes named in ``keep``, relabelled 0..len(keep)-1 in that order."""
    missing = [c for c in keep if c not in classes]
    if missing:
        raise ConfigError(f"data.class_subset={keep!r}: no class(es) {', '.join(map(repr, missing))}; "
                          f"the data has {', '.join(classes)}")
    old_ids = torch.tensor([classes.index(c) for c in keep])
    mask = torch.isin(labels, old_ids)
    remap = torch.full((len(classes),), -1, dtype=torch.long)
    remap[old_ids] = torch.arange(len(keep))
    return images[mask], remap[labels[mask]], list(keep)


def build_splits(cfg: TrainConfig, image_size: Pair) -> Splits:
    dataset, data = load_dataset(cfg, image_size), cfg.data
    images, labels, classes = dataset.images, dataset.labels, list(dataset.classes)
    ids = torch.arange(len(labels))
    if data.class_subset:
        ids = ids[torch.isin(labels, torch.tensor([classes.index(c) for c in data.class_subset if c in classes]))]
        images, labels, classes = select_classes(images, labels, classes, tuple(data.class_subset))
    if data.train_examples and data.train_examples < len(labels):
        # the training pool: a class-stratified sample (the held-out part of a stratified split)
        _, keep = stratified_split(labels, int(data.train_examples), data.split_seed + 1)
        images, labels, ids = images[keep], labels[keep], ids[keep]
    val_images = val_labels = None
    if data.val_split:  # held out of the pool: VTAB-1k's 800 + 200 of 1000
        val_size = int(data.val_split) if data.val_split >= 1 else float(data.val_split)
        train_idx, val_idx = stratified_split(labels, val_size, data.split_seed)
        val_images, val_labels = images[val_idx], labels[val_idx]
        images, labels, ids = images[train_idx], labels[train_idx], ids[train_idx]
    return Splits(images, labels, val_images, val_labels, classes, len(dataset.skipped), train_ids=ids)


def streams(cfg: TrainConfig, image_size: Pair) -> bool:
    """Whether the run streams its training set (``data.stream``; "auto": shard sets, and
    folders whose decoded size exceeds ``data.memory_limit_gb``)."""
    from vitlab.data.stream import is_stream_source

    data = cfg.data
    if data.source == "digits":
        if data.stream == "stream":
            raise ConfigError("data.stream='stream': the built-in digits source is in memory only; use 'auto'")
        return False
    shards = is_stream_source(data.source)
    if data.stream == "memory" and shards:
        raise ConfigError(f"data.stream='memory': data.source={data.source!r} is a shard set, which is streamed; "
                          "use 'auto' or 'stream'")
    if data.stream != "auto" or shards:
        return data.stream == "stream" or shards
    from vitlab.data.stream import scan_folder

    n = len(scan_folder(data.source, data.cache_dir))
    return n * 3 * image_size[0] * image_size[1] > data.memory_limit_gb * 1e9


def stream_splits(cfg: TrainConfig) -> Splits:
    """A streamed training set: its classes and size; no validation split (refused if asked)."""
    from vitlab.data.stream import open_source

    data = cfg.data
    for name, value in (("val_split", data.val_split), ("train_examples", data.train_examples),
                        ("class_subset", data.class_subset)):
        if value:
            raise ConfigError(f"data.{name}={value!r}: a streamed training set has none here; set it to 0 or () "
                              "(--val-split 0), or decode the data into memory (data.stream='memory')")
    source = open_source(data.source, data.cache_dir, seed=cfg.run.seed)
    return Splits(None, None, None, None, list(source.classes), 0, num_train=source.num_samples, source=source)
