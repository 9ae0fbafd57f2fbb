"""Streaming data sets too big for RAM: WebDataset-style tar shards and plain folders.

A shard is an ordinary tar file holding samples as consecutive members that share a
key: ``<key>.jpg`` (the encoded image, as it was stored) and ``<key>.cls`` (the label
as ASCII digits).  Reading a shard is one sequential pass, which keeps network and
spinning disks fast, and shards split naturally across machines and worker processes.

``ShardStream`` gives every (rank, DataLoader worker) pair its own shards: the shard
list is shuffled per epoch with the same seed on every rank, then dealt out with a
stride of world_size * num_workers, so each shard is read by exactly one worker of one
rank.  Within a worker, samples pass through a shuffle buffer.  Use enough shards (at
least ranks x workers, ideally many more) so that no worker idles.
"""
from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from vitlab.config import to_pair
from vitlab.data.loader import derive_seed
from vitlab.data.memory import decode_image
from vitlab.data.sources import (
    IMAGE_EXTENSIONS,
    MAX_MEMBER_BYTES,
    TAR_ERRORS,
    DataError,
    ImageFolderIndex,
    PathLike,
    resolve_data_path,
    scan_image_folder,
)

__all__ = ["pack_shards", "ShardStream", "FolderStream", "collate_samples", "SHARD_PATTERN"]

log = logging.getLogger(__name__)

SHARD_PATTERN = "shard-{:06d}.tar"
OVERSIZED = "/oversized"  # a field name no member extension can produce
Sample = tuple[torch.Tensor, int]


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0  # fixed metadata: packing the same data twice gives identical bytes
    tar.addfile(info, io.BytesIO(data))


def pack_shards(
    image_folder: PathLike,
    out_dir: PathLike,
    samples_per_shard: int = 1000,
    *,
    seed: int = 0,
    cache_dir: Optional[PathLike] = None,
) -> list[Path]:
    """Pack an ImageFolder tree (or archive of one) into tar shards.

    The samples are shuffled with ``seed`` before packing, so each shard holds a mix of
    classes and a stream that reads shards in any order starts out well mixed.  Keys
    are the 9-digit position in that shuffled order; image bytes are copied unchanged
    (``.jpeg`` is stored as ``.jpg``).  ``out_dir/index.json`` records the classes, the
    seed and each shard's name and sample count.

    Returns the shard paths, ``out_dir/shard-000000.tar`` onwards.

    Raises:
        DataError: ``out_dir`` already holds shards, or the source has no images.
    """
    if samples_per_shard < 1:
        raise DataError(f"samples_per_shard={samples_per_shard}: must be >= 1")
    index = scan_image_folder(resolve_data_path(image_folder, cache_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("shard-*.tar")):
        raise DataError(f"{out}: already holds shards; pack into an empty folder")

    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(index))
    shards, entries = [], []
    for s, start in enumerate(range(0, len(order), samples_per_shard)):
        path = out / SHARD_PATTERN.format(s)
        partial = path.with_name(f".{path.name}.partial")
        chunk = order[start : start + samples_per_shard]
        with tarfile.open(partial, "w") as tar:
            for offset, position in enumerate(chunk):
                source = index.paths[position]
                ext = os.path.splitext(source)[1].lower().replace(".jpeg", ".jpg")
                key = f"{start + offset:09d}"
                _add_member(tar, key + ext, Path(source).read_bytes())
                _add_member(tar, key + ".cls", str(int(index.labels[position])).encode())
        os.replace(partial, path)  # a shard that exists is complete
        counts = np.bincount(index.labels[chunk], minlength=len(index.classes))
        entries.append({"name": path.name, "num_samples": len(chunk), "class_counts": counts.tolist()})
        shards.append(path)
    meta = {
        "classes": index.classes,
        "num_samples": len(index),
        "samples_per_shard": samples_per_shard,
        "seed": seed,
        "shards": entries,
    }
    (out / "index.json").write_text(json.dumps(meta, indent=1))
    return shards


def _read_shard(path: Path, skipped: Optional[list] = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Yield (key, {extension: bytes}) for consecutive members sharing a key.

    A damaged shard (truncated, corrupt gzip, garbage) yields the samples before the damage,
    then stops; the damage goes to ``skipped`` as (shard, reason).  A member declaring
    more than ``MAX_MEMBER_BYTES`` is skipped unread, and so is its sample.
    """
    try:
        yield from _read_members(path)
    except TAR_ERRORS as e:
        if skipped is None:
            raise DataError(f"{path}: not a readable tar shard (truncated or corrupt?): {type(e).__name__}: {e}") from e
        skipped.append((path.name, f"unreadable from here on (truncated or corrupt?): {type(e).__name__}: {e}"))


def _read_members(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    key, fields = None, {}
    with tarfile.open(path, "r|*") as tar:  # streaming mode: one sequential read
        for member in tar:
            if not member.isfile():
                continue
            folder, base = os.path.split(member.name)
            stem, dot, ext = base.partition(".")
            member_key = os.path.join(folder, stem)
            if member_key != key:
                if key is not None:
                    yield key, fields
                key, fields = member_key, {}
            if member.size > MAX_MEMBER_BYTES:
                fields[OVERSIZED] = str(member.size).encode()  # never read: the sample is skipped
                continue
            fields[ext.lower()] = tar.extractfile(member).read()
    if key is not None:
        yield key, fields


def _split_sample(fields: dict[str, bytes]) -> tuple[Optional[bytes], str]:
    if OVERSIZED in fields:
        return None, f"a member declares {fields[OVERSIZED].decode()} bytes, more than {MAX_MEMBER_BYTES} (a tar bomb?)"
    images = [v for k, v in fields.items() if f".{k}" in IMAGE_EXTENSIONS]
    if len(images) != 1:
        return None, f"expected one image member, found {len(images)}"
    return images[0], ""


class ShardStream(IterableDataset):
    """Samples from tar shards: (uint8 (3, H, W) tensor, int label).

    shards:         a folder of ``shard-*.tar`` (with ``index.json`` from ``pack_shards``)
                    or an explicit list of shard paths.
    shuffle_buffer: samples held for shuffling within a worker (0 = read in order and
                    keep the shard order too).
    seed:           with ``set_epoch``, fixes the shard order and the buffer shuffle.
    image_size:     int or (H, W): resize every image (bilinear, PIL) so batches stack.
    rank, world_size: default to torch.distributed's when initialised, else 0 and 1.

    Corrupt samples are skipped and listed in ``skipped`` as (shard:key, reason) in the
    process that read them, with one warning per shard that had any.
    """

    def __init__(
        self,
        shards: Union[PathLike, Sequence[PathLike]],
        *,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        image_size: Union[int, tuple[int, int], None] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        self.classes: Optional[list[str]] = None
        self.num_samples: Optional[int] = None
        if isinstance(shards, (str, os.PathLike)):
            folder = Path(shards)
            paths = sorted(folder.glob("shard-*.tar"))
            meta_path = folder / "index.json"
            if meta_path.is_file():
                try:
                    meta = json.loads(meta_path.read_text())
                    self.classes, self.num_samples = list(meta["classes"]), int(meta["num_samples"])
                except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
                    raise DataError(f"{meta_path}: not an index written by pack_shards (needs 'classes' and "
                                    f"'num_samples'): {type(e).__name__}: {e}") from e
        else:
            paths = [Path(p) for p in shards]
        if not paths:
            raise DataError(f"{shards}: no shards found (expected shard-*.tar files)")
        self.shards = paths
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.image_size = None if image_size is None else to_pair(image_size, "image_size")
        if rank is None or world_size is None:
            distributed = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if distributed else 0
            world_size = dist.get_world_size() if distributed else 1
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.skipped: list[tuple[str, str]] = []

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle shards and samples for ``epoch`` (call before creating the iterator)."""
        self.epoch = int(epoch)

    def my_shards(self) -> list[Path]:
        """The shards this (rank, worker) reads in the current epoch."""
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = list(self.shards)
        if self.shuffle_buffer > 0:
            rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, self.epoch)))
            order = [order[i] for i in rng.permutation(len(order))]  # identical on every rank
        total = self.world_size * num_workers
        if len(order) < total:
            log.warning("%d shards for %d readers (ranks x workers): some will idle", len(order), total)
        return order[self.rank * num_workers + worker :: total]

    def _samples(self, shards: list[Path]) -> Iterator[tuple[str, bytes, int]]:
        for shard in shards:
            skipped_before = len(self.skipped)
            for key, fields in _read_shard(shard, self.skipped):
                image, reason = _split_sample(fields)
                try:
                    label = int(fields["cls"].decode().strip())
                except (KeyError, ValueError, UnicodeDecodeError) as e:
                    image, reason = None, f"bad or missing .cls: {type(e).__name__}: {e}"
                if image is None:
                    self.skipped.append((f"{shard.name}:{key}", reason))
                    continue
                yield f"{shard.name}:{key}", image, label
            self._warn_skipped(shard, skipped_before)

    def _warn_skipped(self, shard: Path, before: int) -> None:
        new = self.skipped[before:]
        if new:
            log.warning("%s: skipped %d corrupt sample(s) (first: %s: %s)", shard, len(new), *new[0])

    def __iter__(self) -> Iterator[Sample]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, self.epoch, self.rank, worker + 1)))
        samples = self._samples(self.my_shards())
        if self.shuffle_buffer > 0:
            samples = _shuffle(samples, self.shuffle_buffer, rng)
        for name, data, label in samples:
            # Decoding after the buffer keeps it holding compressed bytes, not pixels.
            try:
                array = decode_image(io.BytesIO(data), self.image_size)
            except DataError as e:
                self.skipped.append((name, str(e)))
                log.warning("%s: skipped corrupt image (%s); %d skipped so far", name, e, len(self.skipped))
                continue
            yield torch.from_numpy(array).permute(2, 0, 1).contiguous(), label


def _shuffle(items: Iterator, size: int, rng: np.random.Generator) -> Iterator:
    """Shuffle a stream with a buffer of ``size``: each output is a random buffered item."""
    buffer: list = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = int(rng.integers(size))
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer


class FolderStream(Dataset):
    """Map-style data set over an ``ImageFolderIndex``, decoded on demand by DataLoader workers.

    ``dataset[i]`` is (uint8 (3, H, W) tensor, label), or None when the image cannot be
    decoded (logged with its path); ``collate_samples`` drops the Nones.
    """

    def __init__(self, index: ImageFolderIndex, image_size: Union[int, tuple[int, int], None] = None) -> None:
        self.index = index
        self.image_size = None if image_size is None else to_pair(image_size, "image_size")

    @classmethod
    def from_path(cls, path: PathLike, image_size: Union[int, tuple[int, int], None] = None,
                  cache_dir: Optional[PathLike] = None) -> "FolderStream":
        """Scan a folder (or extract an archive once, see ``resolve_data_path``) and wrap it."""
        return cls(scan_image_folder(resolve_data_path(path, cache_dir)), image_size)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Optional[Sample]:
        path = self.index.paths[i]
        try:
            array = decode_image(path, self.image_size)
        except DataError as e:
            log.warning("skipped unreadable image: %s", e)
            return None
        return torch.from_numpy(array).permute(2, 0, 1).contiguous(), int(self.index.labels[i])


def collate_samples(samples: Sequence[Optional[Sample]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into (uint8 (B, 3, H, W), int64 (B,)), dropping None (unreadable) ones."""
    kept = [s for s in samples if s is not None]
    if not kept:
        return torch.empty(0, 3, 0, 0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    images = torch.stack([s[0] for s in kept])
    labels = torch.tensor([s[1] for s in kept], dtype=torch.int64)
    return images, labels
