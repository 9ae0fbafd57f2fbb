"""Data for vitlab: folders and archives, in-memory sets, splits, batch transforms,
reproducible batch streams, tar shards, Hugging Face datasets and parquet files streamed
(``stream``), and the CIFAR-10 download.

Typical use for a CIFAR-size set::

    data = load_in_memory("cifar10-train.tar.gz")
    train_idx, val_idx = stratified_split(data.labels, 5000, seed=0)
    cfg = TrainTransform(num_classes=10, crop="pad")
    stream = BatchStream(data.images[train_idx], data.labels[train_idx], 256,
                         shuffle=True, seed=0, transform=build_transform(cfg))
    for images, targets in stream: ...   # float (256, 3, 32, 32) in [-1, 1], (256, 10)
"""
from vitlab.data.cifar import download_cifar10
from vitlab.data.loader import Batches, BatchStream
from vitlab.data.memory import InMemoryDataset, load_in_memory
from vitlab.data.shards import pack_shards
from vitlab.data.sources import DataError, ImageFolderIndex, StreamSource, resolve_data_path, scan_image_folder
from vitlab.data.splits import few_per_class, stratified_sample, stratified_split
from vitlab.data.stream import StreamLoader, hold_out, open_source
from vitlab.data.transforms import (
    Augmentation,
    EvalTransform,
    TrainTransform,
    build_transform,
    mixup_cutmix,
    one_hot_smooth,
    rand_augment,
    random_crop_with_padding,
    random_erasing,
    random_flip,
    random_resized_crop,
    resize,
    to_float,
)

__all__ = [
    "DataError",
    "ImageFolderIndex",
    "scan_image_folder",
    "resolve_data_path",
    "InMemoryDataset",
    "load_in_memory",
    "stratified_split",
    "stratified_sample",
    "few_per_class",
    "to_float",
    "resize",
    "random_resized_crop",
    "random_flip",
    "random_crop_with_padding",
    "rand_augment",
    "mixup_cutmix",
    "one_hot_smooth",
    "random_erasing",
    "Augmentation",
    "TrainTransform",
    "EvalTransform",
    "build_transform",
    "Batches",
    "BatchStream",
    "pack_shards",
    "StreamSource",
    "open_source",
    "hold_out",
    "StreamLoader",
    "download_cifar10",
]
