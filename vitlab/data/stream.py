"""Training data of any size, streamed to one process or many: the one streaming stack.

Sources (``open_source``):

* tar shards (``vitlab.data.shards``): a folder of them, a brace pattern
  ``shards/{000000..000099}.tar`` or a glob ``shards/*.tar``;
* a Hugging Face ``datasets`` folder written by ``save_to_disk``, or parquet files of
  image bytes (a file, a folder of them, a pattern or a glob): ``vitlab.data.hub``;
* an ImageFolder (folder or archive of one) read image by image from disk.

Every source is a list of *units* (a shard, a record batch, a row group, a chunk of a
folder's images) that a reader reads in order.  Epoch ``e`` deals the units, shuffled
by (seed, e) identically on every rank, to the ``world_size * workers`` readers with a
stride, so each unit, and so each sample, is read by exactly one DataLoader worker of
one rank per epoch.  Within a reader the samples pass through a shuffle buffer (of
encoded bytes) seeded by (seed, e, reader).  ``hold_out`` sets a seeded share of the
units aside as a validation set.

Each DataLoader worker is one reader.  It decodes each image straight to its crop at the
training size (``decode.decode_crop``: the inception crop, or a resize; JPEGs at reduced
DCT scale where that still covers the output) and hands over uint8 parts of a batch, the
parts of several consecutive batches in one tensor where they are small (each tensor
handed over costs the training process a file descriptor's transfer).
The per-pixel rest of the augmentation (flip, pad-and-crop, RandAugment, scaling to
[-1, 1], erasing, mixup/CutMix) runs in the training process on the training device,
with the same code as the in-memory path (``transforms``), once on the whole micro-batch:
each reader's part draws its per-image numbers from its own seeded generator
(``draws.PartGenerators``), so a part is augmented the same whichever process gathers
it; mixup and CutMix pair images across the micro-batch.  On CUDA the parts arrive in
pinned memory, are copied into one batch without blocking and augmented on a side stream
one batch ahead, so the next batch is on the device while the step runs.

A reader's sample sequence is a pure function of (seed, epoch, reader), and each reader
runs epoch after epoch without end.  Every batch part carries its reader and how many
samples of which epoch that reader has handed out; ``StreamLoader.state_dict()`` keeps
these counts for the batches the trainer actually took.  Resuming skips exactly that
many samples in each reader (their bytes are read, not decoded): sample-exact, with the
same world size and worker count (anything else is refused).

What a reader cannot read (the rest of a damaged shard) or decode is left out and
counted in its ``Unread`` ledger (``vitlab.data.sources``, the one every reader of a set
keeps), whose new entries travel with its handovers: the ``StreamLoader`` in the training
process warns once per place and counts them (``unread_everywhere``: the run's
``skipped_images``).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import itertools
import os
import logging
import re
import unicodedata
import zlib
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitlab.config import to_pair
from vitlab.data.decode import SampleCrop, decode_crops
from vitlab.data.draws import PartGenerators
from vitlab.data.hub import arrow_source, is_hf_dataset, parquet_source
from vitlab.data.loader import DeviceStage, copy_without_a_wait, derive_seed, one_ahead
from vitlab.data.shards import shard_marks, shard_source
from vitlab.data.sources import (DataError, StreamSource, Unread, check_label_ids, describe_unread, listing_state,
                                 not_data_path, resolve_data_path, scan_image_folder)
from vitlab.data.transforms import TrainTransform, build_transform

__all__ = ["expand_braces", "fitting_workers", "hold_out", "is_stream_source", "open_source", "StreamSource", "StreamDataset",
           "StreamLoader", "units_key"]

log = logging.getLogger(__name__)

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
FOLDER_CHUNK = 256  # images per unit of a streamed folder


def expand_braces(pattern: str) -> list[str]:
    """``a/{000..002}.tar`` -> ``a/000.tar a/001.tar a/002.tar`` (zero padding kept; several ranges multiply)."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    lo, hi = m.group(1), m.group(2)
    if int(hi) < int(lo):
        raise DataError(f"{pattern}: the range {{{lo}..{hi}}} runs backwards")
    width = len(lo) if lo.startswith("0") else 0
    head, tail = pattern[: m.start()], pattern[m.end():]
    return [p for i in range(int(lo), int(hi) + 1) for p in expand_braces(f"{head}{i:0{width}d}{tail}")]


def _named_files(source: str) -> Optional[list[Path]]:
    """The files a brace pattern or a glob names (None for a plain path)."""
    if Path(source).expanduser().exists():  # a file or folder whose name holds [, *, ? or {}: no pattern
        return None
    if _BRACE.search(source):
        paths = [Path(p) for p in expand_braces(source)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DataError(f"{source}: {len(missing)} of {len(paths)} files missing (first: {missing[0]})")
        return paths
    if any(c in source for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(source))
        if not paths:
            raise DataError(f"{source}: the pattern matches no file")
        return paths
    return None


def source_state(source: str) -> tuple:
    """What a per-process cache of ``source`` (its count, its opened ``StreamSource``) is keyed by
    besides its name: ``listing_state``, and for a brace pattern or a glob the files it names and
    the state of each folder they lie in (their sizes and times: shards packed again under the same
    names are another set, whose key is another); () where it names nothing (opening it says so)."""
    try:
        named = _named_files(source)
    except DataError:
        return ()
    if named is None:
        return listing_state(source)
    return (tuple(map(str, named)), *(listing_state(str(folder)) for folder in dict.fromkeys(p.parent for p in named)))


def _streamed_kind(source: str) -> Optional[tuple[str, list[Path]]]:
    """("shards" | "parquet" | "hf", paths) for a source that streams, None for others
    (an ImageFolder or an archive of one)."""
    named = _named_files(source)
    if named is not None:
        kinds = {"parquet" if p.suffix == ".parquet" else "shards" for p in named}
        if len(kinds) > 1:
            raise DataError(f"{source}: names both parquet files and tar shards; name one kind")
        return kinds.pop(), named
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".parquet":
        return "parquet", [path]
    if not path.is_dir():
        return None
    if is_hf_dataset(path):
        return "hf", [path]
    # hidden files and folders are never data (.ipynb_checkpoints beside index.json, the ._shard-000000.tar
    # macOS writes on a foreign disk, an unzipped macOS zip's __MACOSX/): the folder of shards was read as an
    # ImageFolder holding none
    children = [p for p in path.iterdir() if not not_data_path(p.name)]
    if any(p.is_dir() for p in children):
        return None
    for kind, suffix in (("shards", ".tar"), ("parquet", ".parquet")):
        files = sorted(p for p in children if p.suffix == suffix)
        if files:
            return kind, files
    return None


def is_stream_source(source: Optional[str]) -> bool:
    """Whether ``source`` is a set stored to be streamed: tar shards, parquet files or a
    ``save_to_disk`` folder (a folder, a brace pattern or a glob)."""
    return isinstance(source, str) and _streamed_kind(source) is not None


# ----------------------------------------------------------------------------- sources


def _read_folder_chunk(unit: tuple[int, int], skipped: Optional[list] = None, *, paths: list[str],
                       labels: np.ndarray, order: np.ndarray) -> Iterator[tuple[str, object, int]]:
    for i in order[unit[0] : unit[1]]:  # nothing is left out here: an unreadable image fails its decoding
        yield str(paths[i]), str(paths[i]), int(labels[i])


def scan_folder(source: str, cache_dir=None):
    """``scan_image_folder`` of ``source``, listed once per process while the folder's top
    levels, and the folders below its class folders, are unchanged (14M files take a while;
    ``listing_state``)."""
    return _scan_folder(source, cache_dir, listing_state(source))


@functools.lru_cache(maxsize=4)
def _scan_folder(source: str, cache_dir, state: tuple):
    return scan_image_folder(resolve_data_path(source, cache_dir))


def folder_source(source: str, cache_dir=None) -> StreamSource:
    """An ImageFolder read from disk: chunks of ``FOLDER_CHUNK`` images of a fixed permutation
    (the same for every run, so that a held-out share of chunks is a function of its seed
    alone; each epoch shuffles the chunks and the images within reach of the buffer)."""
    index = scan_folder(source, cache_dir)
    order = np.random.Generator(np.random.PCG64(0)).permutation(len(index))
    units = [(s, min(s + FOLDER_CHUNK, len(order))) for s in range(0, len(order), FOLDER_CHUNK)]  # slices of order
    read = functools.partial(_read_folder_chunk, paths=list(index.paths), labels=np.asarray(index.labels),
                             order=order)
    # no key: telling a changed folder apart takes a stat of every image, so a decoded part is not cached
    return StreamSource(units, read, list(index.classes), [b - a for a, b in units], name=source,
                        root=str(index.root))


def open_source(source: str, cache_dir=None) -> StreamSource:
    """The ``StreamSource`` of ``source`` (see the module doc for what it may be).

    Raises:
        DataError: nothing usable there, or a reader's package is missing (its extra named).
    """
    kind = _streamed_kind(source)
    if kind is None:
        return folder_source(source, cache_dir)
    name, paths = kind
    if name == "shards":
        return shard_source(source, paths)
    if name == "parquet":
        return parquet_source(paths, source)
    return arrow_source(paths[0], source)


def hold_out(source: StreamSource, share: float, seed: int) -> tuple[StreamSource, StreamSource]:
    """(training part, held-out part) of ``source``: whole units, drawn in an order seeded
    by ``seed`` until they hold ``share`` samples (a count >= 1) or that fraction of them.

    Raises:
        DataError: the share would take every unit, or leave none held out.
    """
    want = int(share) if share >= 1 else round(float(share) * source.num_samples)
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(source.units))
    taken, held = [], 0
    for i in order:
        if held >= want:
            break
        taken.append(int(i))
        held += source.unit_sizes[i]
    if want < 1 or len(taken) == len(source.units):
        raise DataError(f"data.val_split={share}: {source.name} has {len(source.units)} unit(s) of "
                        f"{source.num_samples} samples; a held-out share of {want} samples would leave "
                        f"{'nothing to train on' if want >= 1 else 'no validation set'} (a streamed set holds out "
                        "whole shards: pack smaller ones, or name a validation set with --val-data)")
    kept = sorted(set(range(len(source.units))) - set(taken))
    return source.subset(kept, "training"), source.subset(sorted(taken), f"held out, seed {seed}")


def units_key(source: StreamSource) -> str:
    """``"<samples>-<hash>"`` (as ``splits.part_key``) of what the units of ``source`` hold, named without
    reading an image: a shard by its name, byte size and its index's record of it (``shards.shard_marks``),
    a row group or record batch by its file's name and size and its place and rows, a folder's chunk by its
    images' names and classes.  What a streamed run's ``split_key`` names its training part by, never
    decoded: shards packed again (another seed, an image swapped) give another key.  A folder's image
    written over in place under its name, and a shard's of as many bytes in a folder of no index, are
    not told apart."""
    units = source.units
    if units and isinstance(units[0], Path):
        marks = shard_marks(units)
    elif units and isinstance(units[0][0], str):  # (file, row group or record batch)
        marks = [f"{Path(file).name}:{i}|{os.stat(file).st_size}|{rows}"
                 for (file, i), rows in zip(units, source.unit_sizes)]
    else:  # a folder's chunks: the paths they hold, nothing read
        head = os.path.join(source.root, "") if source.root else ""
        marks = ["\n".join(f"{key[len(head):] if key.startswith(head) else key}|{source.classes[label]}"
                           for key, _, label in source.read(unit)) for unit in units]
    digest = hashlib.sha256()
    # in any order, as part_key's; names composed (NFC), as a Mac's decomposed ones are another spelling
    for mark in sorted(unicodedata.normalize("NFC", m) for m in marks):
        digest.update(mark.encode("utf-8", "surrogateescape") + b"\0")
    return f"{source.num_samples}-{digest.hexdigest()[:16]}"


# ----------------------------------------------------------------------------- the reader


def reader_crop(augment: Optional[TrainTransform], image_size=None, draft: bool = True) -> SampleCrop:
    """What each reader makes of an image: the inception crop, else a resize to the size."""
    size = (augment.image_size if augment is not None else None) or image_size
    if size is None:
        raise DataError("a streamed set needs an image size: its images are stacked into batches")
    if augment is not None and augment.crop == "inception":
        return SampleCrop(to_pair(size, "image_size"), "inception", augment.crop_scale, augment.crop_ratio, draft)
    return SampleCrop(to_pair(size, "image_size"), "resize", draft=draft)


def device_transform(augment: Optional[TrainTransform]):
    """The batch transform left once the readers made the crops: ``augment`` without its
    inception crop (a pad-and-crop stays: it is per-pixel work), or None."""
    if augment is None:
        return None
    return build_transform(dataclasses.replace(augment, crop="none") if augment.crop == "inception" else augment)


def part_sizes(batch_size: int, workers: int) -> list[int]:
    """Each reader's share of a micro-batch: as equal as can be, the first ones larger."""
    return [batch_size // workers + (w < batch_size % workers) for w in range(workers)]


class StreamDataset(IterableDataset):
    """Endless uint8 batch parts of one rank: each DataLoader worker is one reader (see the
    module doc).

    Yields a reader's parts of ``parts_per_handover`` consecutive micro-batches at once:
    (images (count x n, H, W, 3) uint8, per part: its samples' labels (an int, or a tuple of
    a multi-label sample's), their example ids (ints), (epoch, samples of that epoch handed
    out once the part is full); reader-local worker id; the entries its ``Unread`` ledger
    gained since its last handover (images it could not read or decode), which the
    ``StreamLoader`` in the training process gathers).  ``split_handover`` makes the parts
    of it.  Each tensor a worker hands over costs the training process a file
    descriptor's transfer with a handshake: so there is one per handover, and several
    small parts travel together.
    """

    def __init__(self, source: StreamSource, part_sizes: list[int], *, crop: SampleCrop, seed: int = 0,
                 shuffle_buffer: int = 1000, rank: int = 0, world_size: int = 1) -> None:
        self.source, self.part_sizes, self.crop = source, list(part_sizes), crop
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.rank, self.world_size, self.workers = rank, world_size, len(self.part_sizes)
        self.parts_per_handover = parts_per_handover(min(self.part_sizes))
        self.start: list[tuple[int, int]] = [(0, 0)] * self.workers  # (epoch, consumed) per worker
        self.first = 0  # the reader DataLoader worker 0 plays
        self.unread = Unread()  # this reader's: each worker process has its own copy

    def keys(self, epoch: int, rank: int, world_size: int, worker: int, workers: int) -> Iterator[tuple]:
        """(key, payload, label) of reader (rank, worker) in ``epoch``, in the order it hands them out."""
        units = self.source.units
        order = np.random.Generator(np.random.PCG64(derive_seed(self.seed, epoch))).permutation(len(units))
        readers = world_size * workers
        mine = order[rank * workers + worker :: readers]
        samples = itertools.chain.from_iterable(self.source.read_counted(int(i), self.unread) for i in mine)
        if self.shuffle_buffer > 0:
            rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, epoch, rank * workers + worker, 1)))
            samples = _shuffle(samples, self.shuffle_buffer, rng)
        return samples

    def __iter__(self):
        info = get_worker_info()
        # DataLoader takes batches from its workers in turn starting at 0: ``first`` makes that
        # the reader whose turn was next when the stream was stopped
        worker = ((info.id if info is not None else 0) + self.first) % self.workers
        epoch, consumed = self.start[worker]
        reader = self.rank * self.workers + worker
        size = self.part_sizes[worker]
        handover = _Handover(self.parts_per_handover, size, self.crop.size)
        part = handover.next_part(derive_seed(self.seed, epoch, consumed, reader, 5))
        while True:
            samples = itertools.islice(self.keys(epoch, self.rank, self.world_size, worker, self.workers),
                                       consumed, None)
            any_sample, decoded = consumed > 0, consumed > 0
            while True:
                # the samples this part still needs, decoded together: their crops are drawn in one call
                taken = list(itertools.islice(samples, part.missing()))
                if not taken:
                    break
                any_sample, consumed = True, consumed + len(taken)
                pixels = decode_crops([payload for _, payload, _ in taken], self.crop, part.generator)
                for (key, _, label), image in zip(taken, pixels):
                    if isinstance(image, DataError):
                        self.unread.add(key, 1, str(image))
                        continue
                    decoded = True
                    part.add(image, label, key)
                if part.full():
                    handover.done(part, epoch, consumed)
                    if handover.full():
                        yield handover.images, handover.parts, worker, self.unread.take_new()
                        handover = _Handover(self.parts_per_handover, size, self.crop.size)
                    part = handover.next_part(derive_seed(self.seed, epoch, consumed, reader, 5))
            if not any_sample:
                raise DataError(f"{self.source.name}: reader {reader} (rank {self.rank}, worker {worker}) got no "
                                f"samples in epoch {epoch}; use fewer workers or more shards")
            if not decoded:
                raise DataError(f"{self.source.name}: reader {reader} (rank {self.rank}, worker {worker}) could "
                                f"decode none of its samples in epoch {epoch}")
            epoch, consumed = epoch + 1, 0


HANDOVER_IMAGES = 32  # a reader hands over at least this many images at once, where its parts are smaller


def parts_per_handover(part_size: int) -> int:
    """How many consecutive parts a reader of ``part_size`` images hands over together."""
    return max(1, -(-HANDOVER_IMAGES // max(1, part_size)))


class _Part:
    """One reader's part of a micro-batch, filled sample by sample into its rows of a
    handover; its crops are drawn from a generator seeded where the part starts, so a
    resumed reader draws the same."""

    def __init__(self, images: torch.Tensor, seed: int) -> None:
        self.pixels = images.numpy()
        self.labels: list = []
        self.ids: list[int] = []
        self.generator = torch.Generator().manual_seed(seed)

    def add(self, pixels: np.ndarray, label, key: str) -> None:
        self.pixels[len(self.labels)] = pixels
        self.labels.append(label)
        self.ids.append(zlib.crc32(key.encode("utf-8", "surrogateescape")))  # file names need not be UTF-8

    def missing(self) -> int:
        return self.pixels.shape[0] - len(self.labels)

    def full(self) -> bool:
        return self.missing() == 0


class _Handover:
    """``count`` consecutive parts of one reader in one tensor: what the DataLoader ships."""

    def __init__(self, count: int, size: int, image_size: tuple[int, int]) -> None:
        self.images = torch.empty((count * size, *image_size, 3), dtype=torch.uint8)
        self.size, self.count = size, count
        self.parts: list[tuple] = []  # per full part: (labels, ids, (epoch, consumed))

    def next_part(self, seed: int) -> _Part:
        start = len(self.parts) * self.size
        return _Part(self.images[start : start + self.size], seed)

    def done(self, part: _Part, epoch: int, consumed: int) -> None:
        self.parts.append((part.labels, part.ids, (epoch, consumed)))

    def full(self) -> bool:
        return len(self.parts) == self.count


def as_raised_in_worker(err: Exception) -> Exception:
    """An error a DataLoader worker raised, as the worker raised it: torch raises it again in this
    process with a message of several lines ("Caught DataError in DataLoader worker process 0",
    the worker's traceback, then the error's own line), which a command would print whole; the
    error's own message is that last line, after its type's name."""
    lines = str(err).rstrip().splitlines()
    if len(lines) < 2 or "in DataLoader worker process" not in lines[0]:
        return err
    named = f"{type(err).__module__}.{type(err).__qualname__}: "
    last = lines[-1]
    message = last[len(named):] if last.startswith(named) else last.partition(": ")[2] or last
    try:
        return type(err)(message)
    except TypeError:  # a type built from other arguments: as torch gave it
        return err


def split_handover(handover: tuple) -> list[tuple]:
    """A reader's handover as its parts, in order: (images (n, H, W, 3) uint8, labels (n ints:
    a multi-label sample's first), the part's labels where any sample has several, else
    None, example ids (n ints), worker, epoch, samples of that epoch handed out)."""
    images, parts, worker = handover[:3]
    size = images.shape[0] // len(parts)
    out = []
    for i, (labels, ids, (epoch, consumed)) in enumerate(parts):
        # a sample's labels: a tuple from the reader, a list once the DataLoader has converted it
        multi = labels if any(isinstance(label, (tuple, list)) for label in labels) else None
        first = [int(label[0] if isinstance(label, (tuple, list)) else label) for label in labels]
        out.append((images[i * size : (i + 1) * size], first, multi, list(ids), worker, epoch, consumed))
    return out


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


def multi_hot(labels: list, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, K) host targets with a 1 for every label of each sample (for ``optim.loss='sigmoid_xent'``),
    in place of the transform's one-hot targets of the first label; built on the host so that
    no device value is read back."""
    # a sample's labels: a tuple from the reader, a list once the DataLoader has converted it
    every = [label if isinstance(label, (tuple, list)) else (label,) for label in labels]
    hot = torch.zeros(len(labels), num_classes, dtype=dtype)
    hot[[row for row, ids in enumerate(every) for _ in ids], [i for ids in every for i in ids]] = 1.0
    return hot


def _worker_init(_):
    torch.set_num_threads(1)


def fitting_workers(source: StreamSource, workers: int, world_size: int, batch_size: int) -> tuple[int, str]:
    """(the DataLoader workers per process ``source`` can feed, at most ``workers``; a line
    saying why fewer, or ""): each reader needs a unit (shard) of its own and a share of the
    micro-batch."""
    units = len(source.units)
    fitting = max(0, min(workers, units // world_size, batch_size))
    if fitting == workers:
        return fitting, ""
    readers = world_size * workers
    said = (f"{source.name}: {units} unit(s) (shards) for {world_size} process(es) x {workers} workers, "
            f"micro-batch {batch_size}: {fitting} DataLoader worker(s) per process instead of {workers}")
    if batch_size < min(workers, units // world_size):  # the micro-batch is the limit: more shards would not help
        return fitting, (f"{said}; each reader makes a part of every micro-batch: for them all, a micro-batch of at "
                         f"least {workers} (optim.batch_size / (optim.accum_steps x processes))")
    return fitting, (f"{said}; to use them all, write at least {readers} shards (vitlab pack-shards --per-shard "
                     f"{max(1, source.num_samples // (4 * readers))})")


class StreamLoader:
    """What the trainer iterates: endless (images, targets) micro-batches of this rank, resumable.

    augment: the training augmentation (``TrainTransform``): its crop is made by the readers,
             the rest runs here on ``device`` (``device_transform``).  None: the readers
             resize to ``image_size`` and batches are (uint8 (B, 3, H, W), int64 labels).
    workers: DataLoader worker processes (each one reader); 0 reads in this process.  Each
             makes its ``part_sizes`` share of every micro-batch, so a global batch is a
             function of the readers alone: two processes of one worker each see the same
             global batches as one process of two workers.  Fewer workers than asked only
             where the units (shards) are too few for them, or the batch too small, and a
             warning says so.
    draft:   let readers decode JPEGs at reduced scale where that covers the output.
    """

    def __init__(self, source: StreamSource, batch_size: int, *, augment: Optional[TrainTransform] = None,
                 image_size=None, seed: int = 0, shuffle_buffer: int = 1000, rank: int = 0, world_size: int = 1,
                 workers: int = 1, device: Union[str, torch.device, None] = None, draft: bool = True) -> None:
        units = len(source.units)
        if units < world_size:
            raise DataError(f"{source.name}: {units} shard(s) for {world_size} processes; every process needs "
                            "at least one (pack more, smaller shards)")
        self.workers, why_fewer = fitting_workers(source, workers, world_size, batch_size)
        if why_fewer:
            log.warning("%s", why_fewer)
        readers_here = max(1, self.workers)
        self.dataset = StreamDataset(source, part_sizes(batch_size, readers_here),
                                     crop=reader_crop(augment, image_size, draft), seed=seed,
                                     shuffle_buffer=shuffle_buffer, rank=rank, world_size=world_size)
        self.transform = device_transform(augment)
        # multi-hot targets replace one-hot ones: smoothed or mixed targets (which assume one label) cannot
        self.plain_targets = augment is None or not (augment.label_smoothing or augment.mixup_alpha
                                                     or augment.cutmix_alpha)
        self.seed, self.world_size, self.device = seed, world_size, torch.device(device or "cpu")
        self.positions: list[tuple[int, int]] = list(self.dataset.start)
        self.next_reader = 0  # whose batch comes next
        self.unread = Unread()  # what this rank's readers could not read, handed over with the batches

    def unread_everywhere(self) -> Unread:
        """The images every rank's readers could not read (a collective call under
        torch.distributed): a place met by several ranks counts once."""
        import torch.distributed as dist

        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return self.unread
        ranks = [None] * self.world_size
        dist.all_gather_object(ranks, self.unread.to_list())
        return Unread([entry for rank in ranks for entry in rank])

    def _note_unread(self, entries: list) -> None:
        for entry in self.unread.update(entries):  # each place once, whichever reader met it
            log.warning(describe_unread(*entry))

    def state_dict(self) -> dict:
        """Per rank, per reader: [epoch, samples of that epoch handed out]; a collective
        call under torch.distributed (every rank's positions are gathered)."""
        mine = [list(p) for p in self.positions]
        ranks = [mine]
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, mine)
            nexts = [None] * self.world_size
            dist.all_gather_object(nexts, self.next_reader)
        else:
            nexts = [self.next_reader]
        source = self.dataset.source
        return {"kind": "stream", "world_size": self.world_size, "workers": self.dataset.workers, "ranks": ranks,
                "next_reader": nexts, "unread": self.unread_everywhere().to_list(),
                "shuffle_buffer": self.dataset.shuffle_buffer, "units": len(source.units),
                "samples": source.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "stream":
            raise DataError("--resume: the checkpoint's data position is of an in-memory run, this run streams")
        layout = (state["world_size"], state["workers"])
        if layout != (self.world_size, self.dataset.workers):
            raise DataError(f"--resume: the checkpoint streamed with world_size={layout[0]} x workers={layout[1]}; "
                            f"this run has {self.world_size} x {self.dataset.workers}; a sample-exact continuation "
                            "needs the same")
        # either orders each reader's samples otherwise: the counts would skip other samples than were
        # trained on (checkpoints from before these were recorded are taken as they are)
        buffer = state.get("shuffle_buffer", self.dataset.shuffle_buffer)
        if buffer != self.dataset.shuffle_buffer:
            raise DataError(f"--resume: the checkpoint streamed with data.shuffle_buffer={buffer}; this run has "
                            f"{self.dataset.shuffle_buffer}; a sample-exact continuation needs the same")
        source = self.dataset.source
        saved = (state.get("units", len(source.units)), state.get("samples", source.num_samples))
        if saved != (len(source.units), source.num_samples):
            raise DataError(f"--resume: the checkpoint's training set was {saved[0]} unit(s) of {saved[1]} samples; "
                            f"this run's has {len(source.units)} of {source.num_samples} ({source.name}): the data "
                            "changed since, and its positions would skip other samples than were trained on")
        self.positions = [tuple(p) for p in state["ranks"][self.dataset.rank]]
        self.next_reader = int(state["next_reader"][self.dataset.rank])
        self.unread.update(state.get("unread", []))  # warned about by the run that met them

    def _on_device(self, parts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The readers' parts of one micro-batch, copied to the device into one batch and
        augmented there at once; each part's per-image numbers still come from its own
        generator (``PartGenerators``), seeded where the part starts."""
        sizes = [part[0].shape[0] for part in parts]
        height, width = parts[0][0].shape[1:3]
        if len(parts) == 1:
            images = parts[0][0].to(self.device, non_blocking=True)
        else:  # each (pinned) part straight into its rows of the batch
            images = torch.empty((sum(sizes), height, width, 3), dtype=torch.uint8, device=self.device)
            for part, rows in zip(parts, images.split(sizes)):
                rows.copy_(part[0], non_blocking=True)
        x = images.permute(0, 3, 1, 2).contiguous()  # (B, 3, H, W) on the device

        def column(i: int) -> torch.Tensor:  # the parts' labels or example ids, as one (B,) int64 tensor
            return torch.cat([torch.as_tensor(part[i], dtype=torch.int64) for part in parts])

        y = copy_without_a_wait(column(1), self.device)
        if self.transform is None:
            return x, y
        places = [(self.dataset.rank * self.dataset.workers + int(worker), int(epoch), int(consumed))
                  for _, _, _, _, worker, epoch, consumed in parts]
        seeds = [derive_seed(self.seed, epoch, consumed, reader, 7) for reader, epoch, consumed in places]
        hosts = [torch.Generator().manual_seed(s) for s in seeds] if self.device.type != "cpu" else None
        generators = PartGenerators([torch.Generator(device=self.device).manual_seed(s) for s in seeds], sizes, hosts)
        # the per-batch numbers (mixup's weight, CutMix's box) from the places of all the parts
        batch = torch.Generator().manual_seed(derive_seed(self.seed, 8, *itertools.chain.from_iterable(places)))
        epochs = torch.cat([torch.full((n,), epoch, dtype=torch.int64) for n, (_, epoch, _) in zip(sizes, places)])
        x, y = self.transform(x, y, generators, example_ids=copy_without_a_wait(column(3), self.device),
                              epoch=copy_without_a_wait(epochs, self.device), seed=self.seed, host_generator=batch)
        if all(part[2] is None for part in parts):
            return x, y
        if not self.plain_targets:
            raise DataError("multi-label samples (a .cls of several labels or a .json 'labels' list) need plain "
                            "targets: set augment.label_smoothing=0, augment.mixup_alpha=0 and augment.cutmix_alpha=0")
        labels = [label for part in parts for label in (part[2] if part[2] is not None else part[1])]
        return x, copy_without_a_wait(multi_hot(labels, y.shape[-1], y.dtype), self.device)

    def _batches(self, handovers_in: Iterator) -> Iterator[tuple]:
        """(images, targets, the readers' positions after it, the reader next) per micro-batch:
        one part from every worker of this rank, in turn."""
        positions, next_reader = list(self.positions), self.next_reader
        while True:
            # one handover from every worker: the parts of the next parts_per_handover micro-batches
            handovers = []
            for _ in range(self.dataset.workers):
                try:
                    handover = next(handovers_in)
                except (ValueError, OSError) as err:  # DataError is a ValueError
                    raise as_raised_in_worker(err) from None
                self._note_unread(handover[3])
                handovers.append(split_handover(handover))
                # here, not in the reader: a worker's exception reaches the command with its traceback
                source = self.dataset.source
                for part in handovers[-1]:  # (part[2]: a multi-label part's labels: tuples, and ints of one label)
                    ids = part[1] if part[2] is None else [i for labels in part[2] for i in
                                                           (labels if isinstance(labels, (tuple, list)) else (labels,))]
                    check_label_ids(ids, source.classes, source.name)
            for taken in zip(*handovers):
                for part in taken:
                    positions[int(part[4])] = (int(part[5]), int(part[6]))
                next_reader = (int(taken[-1][4]) + 1) % self.dataset.workers
                x, y = self._on_device(list(taken))
                yield x, y, list(positions), next_reader

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.dataset.start, self.dataset.first = list(self.positions), self.next_reader
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                            worker_init_fn=_worker_init if self.workers else None,
                            persistent_workers=False, pin_memory=self.device.type == "cuda")
        stage = DeviceStage(self.device)
        for x, y, positions, next_reader in one_ahead(self._batches(iter(loader)), stage):
            self.positions, self.next_reader = positions, next_reader  # what the trainer has taken
            yield x, y
