"""WebDataset-style tar shards: the format, how ``vitlab pack-shards`` writes it, how one
shard is read.

A shard is an ordinary tar file holding samples as consecutive members that share a
key: ``<key>.jpg`` (or ``.png``, ...: the encoded image) and its label, ``<key>.cls``
(ASCII digits; "3,17" for a multi-label sample) or ``<key>.json`` (``{"label": 3}``, or
``{"labels": [3, 17]}``).  Reading a shard is one sequential pass, which keeps network
and spinning disks fast, and a shard set splits naturally across machines and worker
processes.  Streaming a shard set (dealing shards to ranks x workers, shuffling,
resuming) is ``vitlab.data.stream``'s, as for every other source.

``pack_shards`` writes shards from an ImageFolder, optionally shrinking large images
(``max_side``) and re-encoding them as JPEG (``quality``): data stored at about the
size it is trained at decodes several times faster, which is how FFCV and most
ImageNet pipelines hold it.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import tarfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
from PIL import Image

from vitlab.data.decode import opened, to_rgb
from vitlab.data.sources import (
    IMAGE_EXTENSIONS,
    MAX_MEMBER_BYTES,
    TAR_ERRORS,
    DataError,
    PathLike,
    StreamSource,
    classes_beside,
    files_key,
    not_data_path,
    resolve_data_path,
    scan_image_folder,
)
from vitlab.config import need_output_folder
from vitlab.data.splits import check_seed

__all__ = ["SHARD_PATTERN", "pack_shards", "read_shard", "shard_source"]

log = logging.getLogger(__name__)

SHARD_PATTERN = "shard-{:06d}.tar"
OVERSIZED = "/oversized"  # a field name no member extension can produce
DEFAULT_QUALITY = 90      # JPEG quality of re-encoded images: ImageNet's own files are about this


# ----------------------------------------------------------------------------- writing


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0  # fixed metadata: packing the same data twice gives identical bytes
    tar.addfile(info, io.BytesIO(data))


class _Hashed:
    """A file being written, and the sha256 of what was written to it (what ``sha256sum`` gives of the file)."""

    def __init__(self, file) -> None:
        self.file, self.hash = file, hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()


def shrunk_jpeg(data: bytes, max_side: Optional[int], quality: int) -> tuple[Optional[bytes], str]:
    """(JPEG bytes, "") of the encoded image ``data`` with its longer side at most
    ``max_side`` (None: any), or (None, the reason) for an image that cannot be decoded."""
    try:
        with opened(io.BytesIO(data)) as img:
            size = img.size
            if max_side is not None and max(size) > max_side:
                size = tuple(max(1, round(s * max_side / max(img.size))) for s in img.size)
                img.draft("RGB", (2 * size[0], 2 * size[1]))  # DCT-scale to no less than twice the target
            pixels = Image.fromarray(to_rgb(img))
            if pixels.size != size:
                pixels = pixels.resize(size, Image.LANCZOS)
    except DataError as e:
        return None, str(e)
    out = io.BytesIO()
    pixels.save(out, format="JPEG", quality=quality)
    return out.getvalue(), ""


def _stored_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image's header; (0, 0) when it has none readable."""
    try:
        with opened(io.BytesIO(data)) as img:
            return img.size
    except DataError:
        return 0, 0


def _encode_chunk(job: tuple[list[str], Optional[int], Optional[int]]) -> list[tuple[Optional[bytes], str, str]]:
    """Worker: (bytes, extension, reason) of each path, shrunk and re-encoded when asked;
    each file is read once."""
    paths, max_side, quality = job
    out = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError as e:  # a link to nothing, an image gone or unreadable: left out, as a run leaves it out
            out.append((None, "", f"not readable: {type(e).__name__}: {e.strerror or e}"))
            continue
        ext = os.path.splitext(path)[1].lower().replace(".jpeg", ".jpg")
        # stored as it is (nothing decoded) unless re-encoded: a quality asked, or a side too long
        if quality is None and (max_side is None or max(_stored_size(data)) <= max_side):
            out.append((data, ext, ""))
            continue
        shrunk, reason = shrunk_jpeg(data, max_side, quality or DEFAULT_QUALITY)
        out.append((shrunk, ".jpg", reason))
    return out


def _encoded(paths: list[str], max_side: Optional[int], quality: Optional[int], workers: int) -> Iterator:
    """``_encode_chunk``'s results for ``paths`` in order, from ``workers`` processes."""
    chunk = 64
    jobs = ((paths[i:i + chunk], max_side, quality) for i in range(0, len(paths), chunk))
    if workers <= 1 or (max_side is None and quality is None):
        for job in jobs:
            yield from _encode_chunk(job)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ctx.Pool(workers) as pool:
        for result in pool.imap(_encode_chunk, jobs):
            yield from result


def pack_shards(
    image_folder: PathLike,
    out_dir: PathLike,
    samples_per_shard: int = 1000,
    *,
    seed: int = 0,
    cache_dir: Optional[PathLike] = None,
    max_side: Optional[int] = None,
    quality: Optional[int] = None,
    workers: int = 1,
) -> list[Path]:
    """Pack an ImageFolder tree (or archive of one) into tar shards.

    The samples are shuffled with ``seed`` before packing, so each shard holds a mix of
    classes and a stream that reads shards in any order starts out well mixed.  Keys
    are the 9-digit position in that shuffled order.

    max_side: images whose longer side exceeds it are shrunk to it (aspect kept; Lanczos)
              and stored as JPEG at ``quality`` (90 when None); None keeps every size.
    quality:  every image is re-encoded as JPEG at this quality (1-100).  None: the
              images that are not shrunk are stored byte for byte as they were
              (``.jpeg`` as ``.jpg``).
    workers:  processes that re-encode.

    ``out_dir/index.json`` records the classes, the seed, the size and quality options,
    each shard's name, sample count, class counts and sha256 (what a streamed run's
    ``split_key`` names its training shards by: ``shard_marks``), and the images left out because
    they could not be read, or decoded for re-encoding.  Returns the shard paths,
    ``out_dir/shard-000000.tar`` onwards.

    Raises:
        DataError: bad options, ``out_dir`` already holds shards or is inside the source folder, or the
            source has no images.
    """
    if samples_per_shard < 1:
        raise DataError(f"samples_per_shard={samples_per_shard}: must be >= 1")
    if max_side is not None and max_side < 1:
        raise DataError(f"max_side={max_side}: must be a positive number of pixels")
    if quality is not None and not 1 <= quality <= 100:
        raise DataError(f"quality={quality}: a JPEG quality in 1..100 (ImageNet's files are about 90)")
    if workers < 0:  # a count of processes (a negative one was taken without a word)
        raise DataError(f"workers={workers}: must be a number of processes >= 0 (0 or 1: this process alone)")
    check_seed(seed)
    # the output first: reading the source (an archive is extracted) can take long
    need_output_folder("out_dir", out_dir)
    out = Path(out_dir)
    source = Path(image_folder).expanduser()
    # shards packed among the images would be read back as part of the ImageFolder (or mix with its classes)
    if source.is_dir() and out.expanduser().resolve().is_relative_to(source.resolve()):
        raise DataError(f"out_dir={str(out_dir)!r} is the source folder or inside it; expected an empty folder "
                        f"outside {source}")
    if any(out.glob("shard-*.tar")):
        raise DataError(f"{out}: already holds shards; pack into an empty folder")
    index = scan_image_folder(resolve_data_path(image_folder, cache_dir))
    out.mkdir(parents=True, exist_ok=True)

    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(index))
    encoded = _encoded([index.paths[i] for i in order], max_side, quality, workers)
    shards, entries, skipped = [], [], []
    for s, start in enumerate(range(0, len(order), samples_per_shard)):
        path = out / SHARD_PATTERN.format(s)
        partial = path.with_name(f".{path.name}.partial")
        chunk = order[start : start + samples_per_shard]
        kept = []
        with open(partial, "wb") as file, tarfile.open(fileobj=(hashed := _Hashed(file)), mode="w") as tar:
            for offset, position in enumerate(chunk):
                data, ext, reason = next(encoded)
                if data is None:
                    skipped.append((index.paths[position], reason))
                    continue
                key = f"{start + offset:09d}"
                _add_member(tar, key + ext, data)
                _add_member(tar, key + ".cls", str(int(index.labels[position])).encode())
                kept.append(position)
        os.replace(partial, path)  # a shard that exists is complete
        counts = np.bincount(index.labels[kept], minlength=len(index.classes))
        entries.append({"name": path.name, "num_samples": len(kept), "class_counts": counts.tolist(),
                        "sha256": hashed.hash.hexdigest()})
        shards.append(path)
    if skipped:
        log.warning("%s: left out %d image(s) that could not be read or decoded (first: %s: %s)", image_folder,
                    len(skipped), *skipped[0])
    meta = {
        "classes": index.classes,
        "num_samples": sum(e["num_samples"] for e in entries),
        "samples_per_shard": samples_per_shard,
        "seed": seed,
        "max_side": max_side,
        "quality": quality if quality is not None else (DEFAULT_QUALITY if max_side is not None else None),
        "shards": entries,
        "skipped": skipped,
    }
    (out / "index.json").write_text(json.dumps(meta, indent=1))
    return shards


# ----------------------------------------------------------------------------- reading


def read_members(path: Path, skipped: Optional[list] = None) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Yield (key, {extension: bytes}) for consecutive members sharing a key, each
    member's bytes read once, in one sequential pass.

    A damaged shard (truncated, corrupt gzip, garbage) yields the samples before the
    damage, then stops; the damage goes to ``skipped`` as (shard, reason), or to a warning
    where ``skipped`` is None.  A member declaring more than ``MAX_MEMBER_BYTES`` is
    skipped unread, and so is its sample.
    """
    try:
        yield from _members(Path(path))
    except TAR_ERRORS as e:
        reason = f"unreadable from here on (truncated or corrupt?): {type(e).__name__}: {e}"
        if skipped is None:
            log.warning("%s: %s", path, reason)
        else:
            skipped.append((Path(path).name, reason))


def _members(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    key, fields = None, {}
    with tarfile.open(path, "r|*") as tar:  # streaming mode: one sequential read
        for member in tar:
            # macOS's tar writes a ._<name> member before each file with extended attributes: a sample of
            # its own between an image and its label, it cut every sample in two (WebDataset skips them too)
            if not member.isfile() or not_data_path(member.name):
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
        # tarfile ends its iteration quietly where a header is cut short: a tar that is whole ends
        # with a block of zeros, read here in full
        ended, where = tar.fileobj.pos - tar.offset >= tarfile.BLOCKSIZE, tar.offset
    if key is not None:
        yield key, fields
    if not ended:
        raise tarfile.ReadError(f"no end-of-archive block after {where:,} bytes of members "
                                f"(the file holds {path.stat().st_size:,})")


def sample_label(fields: dict[str, bytes]):
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


def sample_image(fields: dict[str, bytes]) -> tuple[Optional[bytes], str]:
    """(the encoded image, "") of a sample, or (None, why it has none usable)."""
    if OVERSIZED in fields:
        return None, f"a member declares {fields[OVERSIZED].decode()} bytes, more than {MAX_MEMBER_BYTES} (a tar bomb?)"
    images = [v for k, v in fields.items() if f".{k}" in IMAGE_EXTENSIONS]
    if len(images) != 1:
        return None, f"expected one image member, found {len(images)}"
    return images[0], ""


def read_shard(path: PathLike, skipped: Optional[list] = None) -> Iterator[tuple[str, bytes, object]]:
    """(shard:key, image bytes, label) of one shard; unusable samples and damage are left
    out and appended to ``skipped`` as (name, reason), or logged where it is None."""
    name = Path(path).name
    for key, fields in read_members(Path(path), skipped):
        image, reason = sample_image(fields)
        try:
            label = sample_label(fields)
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            image, reason = None, f"bad or missing label: {type(e).__name__}: {e}"
        if image is None:
            if skipped is None:
                log.warning("%s:%s: skipped (%s)", name, key, reason)
            else:
                skipped.append((f"{name}:{key}", reason))
            continue
        yield f"{name}:{key}", image, label


def count_samples(path: Path) -> int:
    """Samples in a shard, from its member headers (tarfile seeks over the data).  A shard cut
    short is refused: what it held before the cut cannot be counted."""
    try:
        with tarfile.open(path, "r:") as tar:
            keys = {m.name.rsplit("/", 1)[-1].partition(".")[0] + m.name.rpartition("/")[0]
                    for m in tar.getmembers()
                    if m.isfile() and not not_data_path(m.name) and not m.name.endswith((".cls", ".json"))}
            if Path(path).stat().st_size - tar.offset < tarfile.BLOCKSIZE:  # as in _members: no end block
                raise tarfile.ReadError(f"no end-of-archive block after {tar.offset:,} bytes of members")
            return len(keys)
    except TAR_ERRORS as e:
        raise DataError(f"{path}: not a readable tar shard (truncated or corrupt?): {type(e).__name__}: {e}") from e


def _described(source: str, folder: Path) -> tuple[list[str], Optional[dict]]:
    """(class names, {shard name: sample count} or None where no index lists the shards) of the
    shards in ``folder``, from its ``index.json``, else its ``classes.txt``/``classes.json``."""
    index = folder / "index.json"
    if not index.is_file():
        classes = classes_beside(folder)
        if classes is None:
            raise DataError(f"{source}: no index.json, classes.txt or classes.json beside the shards in {folder}; "
                            "write the class names, one a line in label order, into classes.txt")
        return classes, None
    try:
        meta = json.loads(index.read_text())
        classes = list(meta["classes"])
        counts = {e["name"]: int(e["num_samples"]) for e in meta.get("shards", [])}
        if not all(isinstance(c, str) for c in classes) or not isinstance(meta["num_samples"], int):
            raise TypeError("classes must be names and num_samples a count")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise DataError(f"{index}: not an index written by pack_shards (needs 'classes' and 'num_samples'): "
                        f"{type(e).__name__}: {e}") from e
    return classes, counts or None


def shard_marks(paths: Sequence[Path]) -> list[str]:
    """What names each shard's contents without reading it: its name, byte size and what its folder's
    ``index.json`` records of it (sample and class counts, the sha256 ``pack_shards`` wrote; packed again,
    with another seed or an image swapped, a shard has others); a shard of no index, its name and size."""
    entries = {}
    for folder in dict.fromkeys(Path(p).parent for p in paths):
        try:
            meta = json.loads((folder / "index.json").read_text())
            entries[folder] = {e["name"]: e for e in meta.get("shards", []) if isinstance(e, dict) and "name" in e}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):  # no index (classes.txt), or none usable
            entries[folder] = {}
    recorded = ("num_samples", "class_counts", "sha256")
    return [f"{Path(p).name}|{os.stat(p).st_size}|"
            + json.dumps([entries[Path(p).parent].get(Path(p).name, {}).get(k) for k in recorded]) for p in paths]


def _listed(classes: list[str]) -> str:
    return f"{len(classes)} classes ({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})"


def shard_source(source: str, paths: Sequence[Path]) -> StreamSource:
    """The shard set ``paths`` (named ``source`` in messages): one unit per shard.  Class
    names and sample counts come from ``index.json`` (``pack_shards``), else the class
    names from ``classes.txt`` (one a line) or ``classes.json`` beside the shards and the
    counts from the shards' headers.

    A shard's labels are ids into the class list of its own folder: shards of folders whose
    lists differ, or a shard that its folder's ``index.json`` does not list (one of another
    ``pack_shards`` run, copied in), would be read under names that are not theirs, and are
    refused."""
    paths = [Path(p) for p in paths]
    described = {folder: _described(source, folder) for folder in dict.fromkeys(p.parent for p in paths)}
    (first, (classes, _)), *others = described.items()
    for folder, (theirs, _) in others:
        if theirs != classes:
            raise DataError(f"{source}: shards of two sets with different classes: {first} has {_listed(classes)}, "
                            f"{folder} has {_listed(theirs)}; name the shards of one set")
    for path in paths:
        counts = described[path.parent][1]
        if counts is not None and path.name not in counts:
            raise DataError(f"{path}: not one of the {len(counts)} shards its folder's index.json lists (a shard "
                            "of another pack-shards run?); its labels would be read as that index's classes")
    sizes = [described[p.parent][1][p.name] if described[p.parent][1] is not None else count_samples(p)
             for p in paths]
    return StreamSource(paths, read_shard, classes, sizes, name=source, key=files_key(paths, "shards", classes))
