"""Small data sets (CIFAR-size) decoded once into one uint8 tensor in RAM.

Decoding 50,000 JPEGs takes seconds even on a few cores; the training loop then reads
batches by indexing a tensor, and augments them as tensor ops (see ``transforms``), the
way airbench keeps all of CIFAR-10 on the device.  An archive is read in one
sequential pass rather than extracted (writing 50k tiny files costs more than decoding
them).  The decoded arrays are cached as ``.npy`` files in the cache folder, keyed by
the source's key and the image size, so a second run costs one file read.

Unreadable images never stop a run and are never dropped silently: each is left out,
kept in ``InMemoryDataset.skipped`` (the ``Unread`` ledger every reader keeps) with the
reason, and counted in a warning; so is each shard that breaks off early, with the number
of images it took with it.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from vitlab.config import to_pair
from vitlab.data.decode import decode_image, decode_sized, to_rgb  # noqa: F401 - to_rgb: also this module's name
from vitlab.data.sources import (
    DataError,
    PathLike,
    StreamSource,
    Unread,
    check_label_ids,
    default_cache_dir,
    is_archive,
    read_image_archive,
    resolve_data_path,
    scan_image_folder,
    source_key,
)
from vitlab.data.stream import is_stream_source, open_source
from vitlab.machine import usable_cores

__all__ = ["InMemoryDataset", "load_in_memory", "load_source_in_memory", "decode_image", "to_rgb"]

log = logging.getLogger(__name__)

Size = Union[int, tuple[int, int], None]
CACHE_VERSION = 4  # bump when the layout of the cached arrays changes, or what a key names (2: the skipped list
#                   counts images; 3: an archive read into memory takes its links to images, leaves __MACOSX/ out;
#                   4: a shard's ._ members (macOS's resource forks) and __MACOSX/ are no samples); a decoded
#                   set's key carries it (_data_key), so features computed from the earlier decoding are not reused
IDS_FILE = "ids.npy"  # its images' names (image_ids): a copy cached before they were kept lacks it, and is decoded
#                       again, under the same key (its pixels are the same)
SIZES_FILE = "sizes.npy"  # each image's stored (height, width), which its crop's geometry is of: likewise


@dataclass
class InMemoryDataset:
    """A decoded data set.

    images:  (N, 3, H, W) uint8, RGB.
    labels:  (N,) int64 class ids, indices into ``classes``.
    classes: class names, sorted as the folders were.
    skipped: the images that could not be read or decoded and were left out (``Unread``:
             iterating gives (path, reason); ``skipped.images`` counts them, a shard that
             broke off with every image it lost).
    key:     changes when the data does: its source's and the decoding's (CACHE_VERSION); "" when unknown.
    several_labels: the samples of a multi-label (JFT-style) source that had several labels, of
             which ``labels`` keeps the first; None read from a copy cached before it was recorded.
    ids:     (N,) int64: each image's name in its set, the size of its file and its class (``image_ids``):
             what tells which images a part of the set holds without their pixels (``splits.part_key``);
             None: not named.
    label_sets: where samples had several labels, (N, L) int64: each sample's labels, -1 filling
             a row of fewer than L (what an evaluation scores it against); else None.
    sizes:   (N, 2) int64: each image's (height, width) as stored, before it was resized to H x W:
             what a training crop draws its box's area fraction and aspect in (the images are
             stretched to H x W); None: unknown, taken as H x W.
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    skipped: Unread = field(default_factory=Unread)
    key: str = ""
    several_labels: int | None = 0
    ids: torch.Tensor | None = None
    label_sets: torch.Tensor | None = None
    sizes: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def scored_labels(self) -> torch.Tensor:
        """What an evaluation scores each sample against (``vitlab.eval.Evaluator``'s labels):
        ``labels``, or a multi-label set's ``label_sets``, every label of each sample."""
        return self.labels if self.label_sets is None else self.label_sets


Decoded = tuple[Optional[np.ndarray], str, tuple[int, int]]  # (pixels or None, why not, the stored (height, width))


def _decode_chunk(job: tuple[Sequence[Union[str, bytes]], Optional[tuple[int, int]]]) -> list[Decoded]:
    """Worker: decode a chunk of paths or encoded bytes; a bad image gives (None, reason, (0, 0))."""
    sources, size = job
    out: list[Decoded] = []
    for source in sources:
        try:
            pixels, stored = decode_sized(io.BytesIO(source) if isinstance(source, bytes) else source, size)
            out.append((pixels, "", stored))
        except DataError as e:  # the path is kept beside the reason, so drop it from the message
            reason = str(e)
            out.append((None, reason[len(source) + 2:] if isinstance(source, str) and reason.startswith(source)
                        else reason, (0, 0)))
    return out


def _decode_all(
    sources: Sequence[Union[str, bytes]], size: Optional[tuple[int, int]], workers: int
) -> list[Decoded]:
    """Decode in ``workers`` processes, results in input order."""
    # ~8 chunks per worker balance the load without much pickling overhead per chunk.
    chunk = max(64, min(2048, -(-len(sources) // max(1, workers * 8))))
    jobs = [(sources[i : i + chunk], size) for i in range(0, len(sources), chunk)]
    if workers <= 1 or len(jobs) == 1:
        results = [_decode_chunk(job) for job in jobs]
    else:
        # fork: workers start in milliseconds and need only PIL and numpy, no torch state.
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        with ctx.Pool(workers) as pool:
            results = pool.map(_decode_chunk, jobs)
    return [item for chunk_result in results for item in chunk_result]


def _stack(
    decoded: list[Decoded], paths: list[str], labels: np.ndarray, root: Path, skipped: Unread, ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(N, 3, H, W) images, their rows of ``labels`` ((N,), or (N, L) label sets), (N,) ``image_ids`` and
    (N, 2) stored sizes from per-image results (``labels`` and ``ids`` per path); the images that could not
    be decoded go to ``skipped`` (which may hold what could not be read before)."""
    keep = [i for i, (arr, _, _) in enumerate(decoded) if arr is not None]
    for i, (arr, reason, _) in enumerate(decoded):
        if arr is None:
            skipped.add(paths[i], 1, reason)
    if not keep:
        first = next(iter(skipped), ("", "no images"))
        raise DataError(f"{root}: none of the {skipped.images} images could be read or decoded "
                        f"(first: {first[0]}: {first[1]})")
    shape = decoded[keep[0]][0].shape
    for i in keep:
        if decoded[i][0].shape != shape:
            raise DataError(
                f"{root}: images differ in size ({paths[keep[0]]} is {shape[0]}x{shape[1]}, "
                f"{paths[i]} is {decoded[i][0].shape[0]}x{decoded[i][0].shape[1]}); pass image_size=... to resize"
            )
    images = np.empty((len(keep), 3, shape[0], shape[1]), dtype=np.uint8)
    for row, i in enumerate(keep):
        images[row] = decoded[i][0].transpose(2, 0, 1)
    sizes = np.array([decoded[i][2] for i in keep], dtype=np.int64).reshape(-1, 2)
    return images, labels[keep], ids[keep], sizes


def image_ids(names: Sequence[str], sizes: Sequence[int], classes: Sequence[str]) -> np.ndarray:
    """(N,) int64: each image named by its name in its set (a folder's or an archive's path below the class
    root, a shard's ``shard:key``, a Hugging Face set's ``file:batch:row``), the size of its file and its
    class's name (of a shard's sample: packed again with another seed, a position names another image, of
    another class as often as not), hashed; names composed (NFC), as a Mac's decomposed ones are another
    spelling.  What a run's split is recorded by (``splits.part_key``) without reading a pixel: its counts
    alone let as many other images pass, such as an image swapped for another, or shards packed again.
    An image written over in place with another of its size is not told apart."""
    ids = np.empty(len(names), dtype=np.int64)
    for i, (name, size, label) in enumerate(zip(names, sizes, classes)):
        text = "|".join((unicodedata.normalize("NFC", name), str(size), unicodedata.normalize("NFC", label)))
        ids[i] = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).digest(),
                                "little", signed=True)
    return ids


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # gone, or a link to nothing: it fails its decoding and is left out
        return -1


def _below(paths: Sequence[str], root: PathLike) -> list[str]:
    """``paths`` named below ``root`` (the class root: ``<class>/<image>``), so that a set moved or copied
    elsewhere, or read from its archive, names its images as it did."""
    head = os.path.join(str(root), "")
    return [p[len(head):] if p.startswith(head) else p for p in paths]


def _data_key(key: str) -> str:
    """The ``key`` of a set decoded from the source whose key is ``key``: what its images are changes with
    the decoding as well as with the files (CACHE_VERSION), and a cache of what is computed from them (few-shot
    features) is keyed by it.  "" where the source has no key."""
    return f"{key}-v{CACHE_VERSION}" if key else ""


def _cache_folder(key: str, size: Optional[tuple[int, int]], cache_dir: Optional[PathLike]) -> Path:
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    tag = "native" if size is None else f"{size[0]}x{size[1]}"
    return base / "arrays" / f"{key}-{tag}-v{CACHE_VERSION}"


def is_decoded(path: PathLike, image_size: Size, cache_dir: Optional[PathLike] = None) -> bool:
    """Whether ``load_in_memory(path, image_size, cache_dir)`` finds the set decoded at that
    size in the cache, and reads it instead of decoding (what a memory estimate needs to know)."""
    from vitlab.data.stream import is_stream_source, open_source

    key = open_source(str(path), cache_dir).key if is_stream_source(str(path)) else source_key(path)
    folder = _cache_folder(key, to_pair(image_size, "image_size"), cache_dir)
    return bool(key) and (folder / IDS_FILE).is_file() and (folder / SIZES_FILE).is_file()


def _read_cache(folder: Path) -> Optional[InMemoryDataset]:
    """The set decoded into ``folder``, or None: none there, or a copy that cannot be read, said in
    a warning and removed so that the set is decoded and cached again.  A copy cut short (the machine
    stopped before the files renamed into place were on disk; a file removed by hand) stopped every
    run on the data with numpy's error, which names no file."""
    if not folder.is_dir():
        return None
    if not ((folder / IDS_FILE).exists() and (folder / SIZES_FILE).exists()) and (folder / "images.npy").exists():
        # cached by an earlier version, whose images are not named, or their stored sizes not kept: decoded again
        # as they were (without a warning), and cached with both; a run's split is recorded by the names, and
        # a training crop's box is drawn in the stored image's geometry (a copy read with its stretched sizes
        # would crop as if none was stretched)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        meta = json.loads((folder / "meta.json").read_text())
        data = InMemoryDataset(
            images=torch.from_numpy(np.load(folder / "images.npy")),
            labels=torch.from_numpy(np.load(folder / "labels.npy")),
            classes=list(meta["classes"]),
            skipped=Unread(meta["skipped"]),
            several_labels=meta.get("several_labels"),
            ids=torch.from_numpy(np.load(folder / IDS_FILE)),
            sizes=torch.from_numpy(np.load(folder / SIZES_FILE)),
        )
        if (folder / "label_sets.npy").is_file():
            data.label_sets = torch.from_numpy(np.load(folder / "label_sets.npy"))
        if data.images.ndim != 4 or not len(data.images) == len(data.labels) == len(data.ids) == len(data.sizes):
            raise ValueError(f"{len(data.images)} images, {len(data.labels)} labels, {len(data.ids)} names and "
                             f"{len(data.sizes)} sizes")
        if data.sizes.shape != (len(data.images), 2) or data.sizes.dtype != torch.int64 or (data.sizes < 1).any():
            raise ValueError(f"sizes of shape {tuple(data.sizes.shape)} and type {data.sizes.dtype}, or not >= 1")
        if data.label_sets is not None and (data.label_sets.ndim != 2 or len(data.label_sets) != len(data.labels)):
            raise ValueError(f"{len(data.labels)} labels and label sets of shape {tuple(data.label_sets.shape)}")
    except (OSError, ValueError, EOFError, KeyError, TypeError) as err:  # json's and numpy's are ValueErrors
        log.warning("%s: the decoded copy cached there cannot be read (%s: %s); decoding the data again", folder,
                    type(err).__name__, err)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return data


def _write_cache(folder: Path, images: np.ndarray, labels: np.ndarray, classes: list[str], skipped: Unread,
                 several_labels: int = 0, ids: Optional[np.ndarray] = None,
                 label_sets: Optional[np.ndarray] = None, sizes: Optional[np.ndarray] = None) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        np.save(tmp / "images.npy", images)
        np.save(tmp / "labels.npy", labels)
        if ids is not None:
            np.save(tmp / IDS_FILE, ids)
        if sizes is not None:
            np.save(tmp / SIZES_FILE, sizes)
        if label_sets is not None:
            np.save(tmp / "label_sets.npy", label_sets)
        (tmp / "meta.json").write_text(json.dumps({"classes": classes, "skipped": skipped.to_list(),
                                                   "shape": images.shape, "several_labels": several_labels}))
        try:
            os.rename(tmp, folder)  # all the files appear together or not at all
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_in_memory(
    path: PathLike, image_size: Size = None, cache_dir: Optional[PathLike] = None, workers: Optional[int] = None
) -> InMemoryDataset:
    """Decode every image of a data set into RAM, caching the result.

    path:       an ImageFolder folder or a .tar/.tar.gz/.tgz archive of one (read in one
                pass without extracting it), or any streamed source
                (``vitlab.data.stream.open_source``: tar shards, a brace pattern or glob of
                them, a Hugging Face ``save_to_disk`` folder, parquet files).
    image_size: int or (height, width); every image is resized to it (bilinear, PIL).
                Required when the images differ in size; None keeps their common size.
    cache_dir:  where decoded arrays (and extracted archives) live (default
                ``$VITLAB_CACHE`` or ``~/.cache/vitlab``).
    workers:    decoding processes (None: every usable core; a run passes its resolved
                ``data.decode_workers``); 1 or 0 decodes in this process.

    Raises:
        DataError: no images, no class folders, sizes differ without ``image_size``.
    """
    if is_stream_source(str(path)):
        return load_source_in_memory(open_source(str(path), cache_dir), image_size, cache_dir, workers)
    size = None if image_size is None else to_pair(image_size, "image_size")
    workers = usable_cores() if workers is None else workers
    key = source_key(path)
    folder = _cache_folder(key, size, cache_dir)
    data = _read_cache(folder)
    if data is None:
        if is_archive(path) and Path(path).is_file():
            index, sources = read_image_archive(path)  # no extraction: one pass over the archive
            sizes = [len(blob) for blob in sources]
        else:
            index = scan_image_folder(resolve_data_path(path, cache_dir))
            sources = index.paths
            sizes = [_file_size(p) for p in sources]
        ids = image_ids(_below(index.paths, index.root), sizes, [index.classes[i] for i in index.labels])
        decoded = _decode_all(sources, size, workers)
        skipped = Unread()
        images, labels, ids, sizes = _stack(decoded, index.paths, index.labels, index.root, skipped, ids)
        _write_cache(folder, images, labels, index.classes, skipped, ids=ids, sizes=sizes)
        data = InMemoryDataset(torch.from_numpy(images), torch.from_numpy(labels), index.classes, skipped,
                               ids=torch.from_numpy(ids), sizes=torch.from_numpy(sizes))
    data.key = _data_key(key)
    _warn_skipped(path, data)
    return data


def load_source_in_memory(source: StreamSource, image_size: Size = None, cache_dir: Optional[PathLike] = None,
                          workers: Optional[int] = None) -> InMemoryDataset:
    """Decode every sample of a streamed source (or of a part of one, ``hold_out``) into
    RAM, cached under ``source.key`` (when it has one); each sample's bytes are read once.  A multi-label
    sample's ``labels`` is its first label, its ``label_sets`` row all of them.  Arguments and errors as
    ``load_in_memory``'s."""
    size = None if image_size is None else to_pair(image_size, "image_size")
    workers = usable_cores() if workers is None else workers
    folder = _cache_folder(source.key, size, cache_dir) if source.key else None
    data = _read_cache(folder) if folder is not None else None
    # cached before the samples of several labels were counted, or before their labels were kept: decoded again
    if data is not None and (data.several_labels is None or (data.several_labels and data.label_sets is None)):
        shutil.rmtree(folder, ignore_errors=True)
        data = None
    if data is None:
        keys, payloads, rows, skipped, several = [], [], [], Unread(), 0
        for key, payload, label in source.samples(skipped):
            label = label if isinstance(label, tuple) else (label,)
            check_label_ids(label, source.classes, source.name, key)
            keys.append(key)
            payloads.append(payload)
            rows.append(label)
            several += len(label) > 1
        ids = image_ids(_below(keys, source.root) if source.root else keys,
                        [len(p) if isinstance(p, bytes) else _file_size(p) for p in payloads],
                        [source.classes[row[0]] for row in rows])
        decoded = _decode_all(payloads, size, workers)
        del payloads
        label_sets = np.full((len(rows), max(map(len, rows), default=1)), -1, dtype=np.int64)
        for i, row in enumerate(rows):
            label_sets[i, :len(row)] = row
        images, label_sets, ids, sizes = _stack(decoded, keys, label_sets, source.name, skipped, ids)
        labels, label_sets = np.ascontiguousarray(label_sets[:, 0]), label_sets if several else None
        if folder is not None:
            _write_cache(folder, images, labels, source.classes, skipped, several, ids, label_sets, sizes)
        data = InMemoryDataset(torch.from_numpy(images), torch.from_numpy(labels), list(source.classes), skipped,
                               several_labels=several, ids=torch.from_numpy(ids),
                               label_sets=None if label_sets is None else torch.from_numpy(label_sets),
                               sizes=torch.from_numpy(sizes))
    data.key = _data_key(source.key)
    _warn_skipped(source.name, data)
    return data


def _warn_skipped(path, data: InMemoryDataset) -> None:
    """A line for each shard that broke off, and one counting every image left out (from the
    cache too: never silent)."""
    for line in data.skipped.units():
        log.warning(line)
    if data.skipped.images:
        first = next((f"{where}: {reason}" for where, (_, reason, of) in data.skipped.entries.items() if of is None),
                     None)  # the first image's: the units are named above
        log.warning("%s: skipped %d unreadable image(s) of %d%s", path, data.skipped.images,
                    len(data) + data.skipped.images, f" (first: {first})" if first else "")
