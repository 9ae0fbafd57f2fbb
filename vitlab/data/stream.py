"""Training data of any size, streamed to one process or many: shards and large folders.

Sources (``open_source``):

* a folder of WebDataset-style tar shards: ``<key>.jpg``/``.jpeg``/``.png``/... + ``<key>.cls``
  (ASCII label; "3,17" for several) or ``<key>.json`` (``{"label": 3}``; ``{"labels": [3, 17]}``:
  multi-hot targets for the sigmoid cross-entropy of JFT-style pre-training), what ``vitlab pack-shards`` writes
  (its ``index.json`` gives the class names and sample count) and what other tools write
  (then ``classes.txt``, one class name a line, or ``classes.json`` beside the shards);
* a brace pattern ``shards/{000000..000099}.tar`` or a glob ``shards/*.tar``;
* an ImageFolder (folder or archive of one) read image by image from disk.

Every source is a list of *units* (a shard; a chunk of the folder's images) that a
reader reads in order.  Epoch ``e`` deals the units, shuffled by (seed, e) identically
on every rank, to the ``world_size * workers`` readers with a stride, so each unit, and
so each sample, is read by exactly one DataLoader worker of one rank per epoch.  Within
a reader the samples pass through a shuffle buffer seeded by (seed, e, reader).

A reader's sample sequence is therefore a pure function of (seed, epoch, reader), and
each reader runs epoch after epoch without end.  Every batch part carries its reader and how
many samples of which epoch that reader has handed out; ``StreamLoader.state_dict()``
keeps these counts for the batches the trainer actually took.  Resuming skips exactly
that many samples in each reader (their bytes are read, not decoded): sample-exact, with
the same world size and worker count (anything else is refused).

Decoding (resized to the training size) and augmentation run in the workers.
"""
from __future__ import annotations

import functools
import glob
import itertools
import json
import logging
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitlab.data.loader import derive_seed
from vitlab.data.sources import DataError

__all__ = ["expand_braces", "is_stream_source", "open_source", "StreamSource", "StreamDataset", "StreamLoader"]

log = logging.getLogger(__name__)

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


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


def _shard_list(source: str) -> Optional[list[Path]]:
    """The shard paths ``source`` names, or None when it is no shard source."""
    if _BRACE.search(source):
        paths = [Path(p) for p in expand_braces(source)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DataError(f"{source}: {len(missing)} of {len(paths)} shards missing (first: {missing[0]})")
        return paths
    if any(c in source for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(source))
        if not paths:
            raise DataError(f"{source}: the pattern matches no file")
        return paths
    folder = Path(source)
    if folder.is_dir():
        tars = sorted(folder.glob("*.tar"))
        if tars and not any(p.is_dir() for p in folder.iterdir()):
            return tars
    return None


def is_stream_source(source: Optional[str]) -> bool:
    """Whether ``source`` is a shard set (folder of .tar shards, brace pattern or glob)."""
    return isinstance(source, str) and _shard_list(source) is not None


# ----------------------------------------------------------------------------- sources


@dataclass
class StreamSource:
    """units: what readers read; read(unit) yields (key, payload, label); payload is bytes or a path."""

    units: list
    read: Callable[[object], Iterator[tuple[str, object, int]]]
    classes: list[str]
    num_samples: int
    name: str = ""
    skipped: list = field(default_factory=list)


def _shard_label(fields: dict[str, bytes]):
    """An int, or a tuple of ints for a multi-label sample (JFT-style: ``.cls`` "3,17" or
    ``.json`` {"labels": [3, 17]})."""
    if "cls" in fields:
        text = fields["cls"].decode().strip()
        return tuple(int(v) for v in text.split(",")) if "," in text else int(text)
    if "json" in fields:
        meta = json.loads(fields["json"])
        if isinstance(meta.get("labels"), list):
            return tuple(int(v) for v in meta["labels"])
        for key in ("label", "cls", "class"):
            if key in meta:
                return int(meta[key])
        raise ValueError(f"the .json has no label field (expected one of label, labels, cls, class): {sorted(meta)}")
    raise KeyError("no .cls or .json member")


def read_shard(path: Path) -> Iterator[tuple[str, bytes, int]]:
    """(shard:key, image bytes, label) of one shard; unusable samples are logged and left out."""
    from vitlab.data.shards import _read_shard, _split_sample

    for key, fields in _read_shard(Path(path)):
        image, reason = _split_sample(fields)
        try:
            label = _shard_label(fields)
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            image, reason = None, f"bad or missing label: {type(e).__name__}: {e}"
        if image is None:
            log.warning("%s:%s: skipped (%s)", Path(path).name, key, reason)
            continue
        yield f"{Path(path).name}:{key}", image, label


def _count_samples(paths: Sequence[Path]) -> int:
    import tarfile

    keys = 0
    for p in paths:
        with tarfile.open(p, "r:") as tar:  # headers only: tarfile seeks over the data
            keys += len({m.name.rsplit("/", 1)[-1].partition(".")[0] + m.name.rpartition("/")[0]
                         for m in tar.getmembers() if m.isfile() and not m.name.endswith((".cls", ".json"))})
    return keys


def shard_source(source: str, paths: list[Path]) -> StreamSource:
    folder = paths[0].parent
    index, classes_txt, classes_json = folder / "index.json", folder / "classes.txt", folder / "classes.json"
    num_samples = None
    if index.is_file():
        meta = json.loads(index.read_text())
        classes = list(meta["classes"])
        counts = {e["name"]: e["num_samples"] for e in meta.get("shards", [])}
        if all(p.name in counts for p in paths):
            num_samples = sum(counts[p.name] for p in paths)
    elif classes_txt.is_file():
        classes = [line.strip() for line in classes_txt.read_text().splitlines() if line.strip()]
    elif classes_json.is_file():
        classes = list(json.loads(classes_json.read_text()))
    else:
        raise DataError(f"{source}: no index.json, classes.txt or classes.json beside the shards in {folder}; "
                        "write the class names, one a line in label order, into classes.txt")
    if num_samples is None:
        num_samples = _count_samples(paths)
    return StreamSource(list(paths), read_shard, classes, num_samples, name=source)


FOLDER_CHUNK = 256  # images per unit of a streamed folder


@functools.lru_cache(maxsize=4)
def scan_folder(source: str, cache_dir=None):
    """``scan_image_folder`` of ``source``, listed once per process (14M files take a while)."""
    from vitlab.data.sources import resolve_data_path, scan_image_folder

    return scan_image_folder(resolve_data_path(source, cache_dir))


def folder_source(source: str, cache_dir=None, seed: int = 0) -> StreamSource:
    """An ImageFolder read from disk: chunks of ``FOLDER_CHUNK`` images of a seeded permutation."""
    index = scan_folder(source, cache_dir)
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(index))
    paths, labels = list(index.paths), np.asarray(index.labels)
    units = [(s, min(s + FOLDER_CHUNK, len(order))) for s in range(0, len(order), FOLDER_CHUNK)]  # slices of order

    def read(unit) -> Iterator[tuple[str, object, int]]:
        for i in order[unit[0] : unit[1]]:
            yield str(paths[i]), str(paths[i]), int(labels[i])

    return StreamSource(units, read, list(index.classes), len(index), name=source)


def open_source(source: str, cache_dir=None, seed: int = 0) -> StreamSource:
    shards = _shard_list(source)
    return shard_source(source, shards) if shards is not None else folder_source(source, cache_dir, seed)


# ----------------------------------------------------------------------------- the reader


class StreamDataset(IterableDataset):
    """Endless batches of one rank: each DataLoader worker is one reader (see the module doc).

    Yields (images, targets, reader-local worker id, epoch, samples of that epoch handed
    out so far); ``transform`` (a ``BatchTransform``) runs here, in the worker.
    """

    def __init__(self, source: StreamSource, batch_size: int, *, image_size, transform=None, seed: int = 0,
                 shuffle_buffer: int = 1000, rank: int = 0, world_size: int = 1, workers: int = 1) -> None:
        self.source, self.batch_size, self.transform = source, batch_size, transform
        self.image_size, self.seed, self.shuffle_buffer = image_size, seed, shuffle_buffer
        self.rank, self.world_size, self.workers = rank, world_size, max(1, workers)
        self.start: list[tuple[int, int]] = [(0, 0)] * self.workers  # (epoch, consumed) per worker
        self.first = 0  # the reader DataLoader worker 0 plays

    def keys(self, epoch: int, rank: int, world_size: int, worker: int, workers: int) -> Iterator[tuple]:
        """(key, payload, label) of reader (rank, worker) in ``epoch``, in the order it hands them out."""
        units = self.source.units
        order = np.random.Generator(np.random.PCG64(derive_seed(self.seed, epoch))).permutation(len(units))
        readers = world_size * workers
        mine = [units[i] for i in order[rank * workers + worker :: readers]]
        samples = itertools.chain.from_iterable(self.source.read(u) for u in mine)
        if self.shuffle_buffer > 0:
            from vitlab.data.shards import _shuffle

            rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, epoch, rank * workers + worker, 1)))
            samples = _shuffle(samples, self.shuffle_buffer, rng)
        return samples

    def _decode(self, payload):
        import io

        from vitlab.data.memory import decode_image

        data = io.BytesIO(payload) if isinstance(payload, bytes) else payload
        return torch.from_numpy(decode_image(data, self.image_size)).permute(2, 0, 1)

    def __iter__(self):
        info = get_worker_info()
        # DataLoader takes batches from its workers in turn starting at 0: ``first`` makes that
        # the reader whose turn was next when the stream was stopped
        worker = ((info.id if info is not None else 0) + self.first) % self.workers
        epoch, consumed = self.start[worker]
        reader = self.rank * self.workers + worker
        images, labels, ids = [], [], []
        while True:
            samples = itertools.islice(self.keys(epoch, self.rank, self.world_size, worker, self.workers),
                                       consumed, None)
            any_sample = consumed > 0
            for key, payload, label in samples:
                any_sample = True
                consumed += 1
                try:
                    images.append(self._decode(payload))
                except Exception as e:  # noqa: BLE001 - PIL raises many types for bad data
                    log.warning("%s: skipped unreadable image (%s: %s)", key, type(e).__name__, e)
                    continue
                labels.append(label)
                ids.append(zlib.crc32(key.encode()))
                if len(images) == self.batch_size:
                    yield self._batch(images, labels, ids, worker, reader, epoch, consumed)
                    images, labels, ids = [], [], []
            if not any_sample:
                raise DataError(f"{self.source.name}: reader {reader} (rank {self.rank}, worker {worker}) got no "
                                f"samples in epoch {epoch}; use fewer workers or more shards")
            epoch, consumed = epoch + 1, 0

    def _batch(self, images, labels, ids, worker, reader, epoch, consumed):
        multi = any(isinstance(label, tuple) for label in labels)
        first = [label[0] if isinstance(label, tuple) else label for label in labels]
        x, y = torch.stack(images), torch.tensor(first, dtype=torch.int64)
        if self.transform is not None:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, consumed, reader, 7))
            x, y = self.transform(x, y, generator, example_ids=torch.tensor(ids, dtype=torch.int64),
                                  epoch=epoch, seed=self.seed)
            if multi:
                y = multi_hot(labels, y)
        return x, y, worker, epoch, consumed


def multi_hot(labels: list, targets: torch.Tensor) -> torch.Tensor:
    """(B, K) targets with a 1 for every label of each sample (for ``optim.loss='sigmoid_xent'``),
    replacing the transform's one-hot targets of the first label; refused when the transform
    smoothed or mixed them (those assume one label)."""
    if not bool(((targets == 0) | (targets == 1)).all()):
        raise DataError("multi-label samples (a .cls of several labels or a .json 'labels' list) need plain "
                        "targets: set augment.label_smoothing=0, augment.mixup_alpha=0 and augment.cutmix_alpha=0")
    hot = torch.zeros_like(targets)
    for row, label in enumerate(labels):
        hot[row, list(label) if isinstance(label, tuple) else [label]] = 1.0
    return hot


def _worker_init(_):
    torch.set_num_threads(1)


class StreamLoader:
    """What the trainer iterates: endless (images, targets) micro-batches of this rank, resumable.

    workers: DataLoader worker processes (each one reader); 0 reads in this process.  Each
    worker makes ``batch_size / workers`` of every micro-batch (the count is lowered until
    it divides), so a global batch is a function of the readers alone: two processes of
    one worker each see the same global batches as one process of two workers.
    """

    def __init__(self, source: StreamSource, batch_size: int, *, image_size, transform=None, seed: int = 0,
                 shuffle_buffer: int = 1000, rank: int = 0, world_size: int = 1, workers: int = 2,
                 device=None) -> None:
        units = len(source.units)
        if units < world_size:
            raise DataError(f"{source.name}: {units} shard(s) for {world_size} processes; every process needs "
                            "at least one (pack more, smaller shards)")
        self.workers = max(0, min(workers, units // world_size))
        while self.workers > 1 and batch_size % self.workers:  # each worker makes an equal part of a batch
            self.workers -= 1
        if self.workers < workers:
            log.warning("%s: %d units for %d processes, micro-batch %d: %d DataLoader worker(s) each instead of %d",
                        source.name, units, world_size, batch_size, self.workers, workers)
        self.dataset = StreamDataset(source, batch_size // max(1, self.workers), image_size=image_size,
                                     transform=transform, seed=seed,
                                     shuffle_buffer=shuffle_buffer, rank=rank, world_size=world_size,
                                     workers=max(1, self.workers))
        self.world_size, self.device = world_size, torch.device(device or "cpu")
        self.positions: list[tuple[int, int]] = list(self.dataset.start)
        self.next_reader = 0  # whose batch comes next

    def state_dict(self) -> dict:
        """Per rank, per reader: [epoch, samples of that epoch handed out]; a collective
        call under torch.distributed (every rank's positions are gathered)."""
        import torch.distributed as dist

        mine = [list(p) for p in self.positions]
        ranks = [mine]
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, mine)
            nexts = [None] * self.world_size
            dist.all_gather_object(nexts, self.next_reader)
        else:
            nexts = [self.next_reader]
        return {"kind": "stream", "world_size": self.world_size, "workers": max(1, self.workers), "ranks": ranks,
                "next_reader": nexts}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "stream":
            raise DataError("--resume: the checkpoint's data position is of an in-memory run, this run streams")
        layout = (state["world_size"], state["workers"])
        if layout != (self.world_size, max(1, self.workers)):
            raise DataError(f"--resume: the checkpoint streamed with world_size={layout[0]} x workers={layout[1]}; "
                            f"this run has {self.world_size} x {max(1, self.workers)}; a sample-exact continuation "
                            "needs the same")
        self.positions = [tuple(p) for p in state["ranks"][self.dataset.rank]]
        self.next_reader = int(state["next_reader"][self.dataset.rank])

    def __iter__(self):
        self.dataset.start, self.dataset.first = list(self.positions), self.next_reader
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                            worker_init_fn=_worker_init if self.workers else None,
                            persistent_workers=False, pin_memory=self.device.type == "cuda")
        parts = []
        for x, y, worker, epoch, consumed in loader:
            self.positions[worker] = (int(epoch), int(consumed))
            self.next_reader = (int(worker) + 1) % self.dataset.workers
            parts.append((x, y))
            if len(parts) == self.dataset.workers:  # one part from every worker of this rank
                x, y = (torch.cat(t) for t in zip(*parts)) if len(parts) > 1 else parts[0]
                parts = []
                yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
