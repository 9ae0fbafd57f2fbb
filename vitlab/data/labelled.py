"""A labelled set named by the user, decoded into memory: what `train` (its training set
in memory, its validation set), `eval` and `fewshot` read.

``source`` takes every form the data may come in: an ImageFolder folder or archive,
tar shards (a folder, a brace pattern ``shards/shard-{000000..000009}.tar``, a glob),
a Hugging Face ``save_to_disk`` folder, parquet files, or the built-in "digits".
"""
from __future__ import annotations

from typing import Optional, Union

from vitlab.config import to_pair
from vitlab.data.digits import load_digits_dataset
from vitlab.data.memory import InMemoryDataset, load_in_memory, load_source_in_memory
from vitlab.data.sources import DataError, PathLike
from vitlab.data.stream import hold_out, open_source

__all__ = ["load_labelled"]


def load_labelled(source: str, image_size, cache_dir: Optional[PathLike] = None, workers: Union[int, str, None] = None,
                  held_out: Optional[tuple[float, int]] = None) -> InMemoryDataset:
    """``source`` decoded at ``image_size`` (int or (H, W)); its ``key`` names the data and
    the size (what features computed from it can be cached under).

    held_out: (share, seed): only the whole units (shards) a streamed training run held out
        for validation with ``data.val_split=share`` and ``data.split_seed=seed``
        (``vitlab.data.stream.hold_out``).

    Raises:
        DataError: nothing usable at ``source`` (see ``load_in_memory``).
    """
    size = to_pair(image_size, "image_size")
    if source == "digits":
        if size[0] != size[1]:
            raise DataError(f"img_size={size}: the digits source makes square images only")
        data = load_digits_dataset(size[0])
        data.key = f"digits@{size[0]}"
        return data
    if held_out is not None:
        _, part = hold_out(open_source(source, cache_dir), *held_out)
        data = load_source_in_memory(part, size, cache_dir, workers)
    else:
        data = load_in_memory(source, image_size=size, cache_dir=cache_dir, workers=workers)
    data.key = f"{data.key}@{size[0]}x{size[1]}"
    return data
