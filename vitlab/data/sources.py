"""Where images come from: ImageFolder trees and tar archives of them.

``scan_image_folder`` lists an ImageFolder tree (``<root>/<class>/<image>``) into paths
and integer labels, classes sorted by name as torchvision's ImageFolder sorts them, so
label ids agree with other code that reads the same folder.  A class folder without an
image is warned of, unless it holds the file ``EMPTY_CLASS_MARK``: a tree written to hold
every class of a task, some of them empty by design (a VTAB split, ``vitlab.eval.vtab``).

``resolve_data_path`` turns a ``.tar``/``.tar.gz``/``.tgz`` archive into a folder by
extracting it once into a cache.  The cache key is cheap (absolute path, size, mtime),
so a second call costs one ``stat``; the extraction lands in a temporary folder that
is renamed into place only when complete, so a killed run never leaves a half folder
that a later run would mistake for a finished one.

The environment ($VITLAB_CACHE, $VITLAB_MAX_ARCHIVE_MEMBERS, $VITLAB_MAX_ARCHIVE_BYTES) is
read once per call, by the public functions, and only where their ``cache_dir`` or
``limits`` argument is left None; the helpers below them take the values as arguments.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

__all__ = [
    "ArchiveLimits",
    "DataError",
    "check_label_ids",
    "StreamSource",
    "Unread",
    "files_key",
    "ImageFolderIndex",
    "IMAGE_EXTENSIONS",
    "scan_image_folder",
    "holds_class_images",
    "listing_state",
    "not_data_path",
    "read_image_archive",
    "count_archive_images",
    "resolve_data_path",
    "default_cache_dir",
    "is_archive",
    "source_key",
]

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

EMPTY_CLASS_MARK = ".empty-class"  # in a class folder: it holds no image by design (not warned of)
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"})
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class DataError(ValueError):
    """Data that cannot be used as asked: missing, empty, malformed or unsafe."""


# Limits on what an archive may hold, against tar bombs (a flood of tiny files, or a huge
# declared size).  Generous for real data sets (ImageNet-21k: 14M images, ~1.3 TB);
# override with $VITLAB_MAX_ARCHIVE_MEMBERS and $VITLAB_MAX_ARCHIVE_BYTES.
MAX_ARCHIVE_MEMBERS = 20_000_000
MAX_ARCHIVE_BYTES = 4 << 40  # 4 TiB
MAX_MEMBER_BYTES = 1 << 30   # one image (or shard member) over 1 GiB is not an image

# What a damaged tar (or its gzip layer) raises while it is read.
TAR_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error, ValueError, TypeError, UnicodeError)


@dataclass(frozen=True)
class ArchiveLimits:
    """How much an archive may hold before it is refused as a tar bomb."""

    members: int = MAX_ARCHIVE_MEMBERS
    total_bytes: int = MAX_ARCHIVE_BYTES
    member_bytes: int = MAX_MEMBER_BYTES

    @classmethod
    def from_env(cls) -> "ArchiveLimits":
        def read(var: str, default: int) -> int:
            text = os.environ.get(var)
            if text is None:
                return default
            try:
                value = int(text)
            except ValueError:
                raise DataError(f"${var}={text!r}: must be a positive integer") from None
            if value <= 0:
                raise DataError(f"${var}={text!r}: must be a positive integer")
            return value

        return cls(read("VITLAB_MAX_ARCHIVE_MEMBERS", MAX_ARCHIVE_MEMBERS),
                   read("VITLAB_MAX_ARCHIVE_BYTES", MAX_ARCHIVE_BYTES), MAX_MEMBER_BYTES)


class _Budget:
    """Counts members and declared bytes of one archive against ``ArchiveLimits``."""

    def __init__(self, archive: Path, limits: ArchiveLimits, free_bytes: int | None = None) -> None:
        self.archive, self.limits, self.free = archive, limits, free_bytes
        self.members = self.bytes = 0

    def take(self, member: tarfile.TarInfo) -> None:
        self.members += 1
        if self.members > self.limits.members:
            raise DataError(
                f"{self.archive}: more than {self.limits.members} members (a tar bomb?); "
                "raise $VITLAB_MAX_ARCHIVE_MEMBERS if the archive is genuine"
            )
        if member.isfile():
            self.bytes += member.size
            if self.bytes > self.limits.total_bytes:
                raise DataError(
                    f"{self.archive}: declares more than {self.limits.total_bytes} bytes (a tar bomb?); "
                    "raise $VITLAB_MAX_ARCHIVE_BYTES if the archive is genuine"
                )
            if self.free is not None and self.bytes > self.free:
                raise DataError(
                    f"{self.archive}: declares more than the {self.free} bytes free in the cache folder"
                )


@dataclass(frozen=True)
class ImageFolderIndex:
    """The images of an ImageFolder tree.

    root:    the folder that holds the class folders.
    paths:   N image paths, grouped by class, sorted within each class.
    labels:  (N,) int64 class ids, indices into ``classes``.
    classes: class folder names, sorted.
    """

    root: Path
    paths: list[str]
    labels: np.ndarray
    classes: list[str]
    ignored: tuple[str, ...] = ()  # files left out because their extension is not an image's

    def __len__(self) -> int:
        return len(self.paths)

    def counts(self) -> np.ndarray:
        """(num_classes,) int64 number of images per class."""
        return np.bincount(self.labels, minlength=len(self.classes))


class Unread:
    """The images of a data set that could not be read or decoded, and left out: per place
    (an image, or a shard or other unit that broke off before its end), how many images and
    why.  The one ledger every reader of a set keeps: ``load_in_memory`` and the streaming
    readers in their worker processes alike (``vitlab.data.stream`` hands each worker's new
    entries over with its batches).  A place counts once however often it is read (epochs, a
    resumed run, several processes).

    Iterating gives (where, reason); ``images`` is the count of images lost.
    """

    def __init__(self, entries: Sequence = ()) -> None:
        self.entries: dict[str, tuple[int, str, Optional[int]]] = {}  # where -> (images, reason, the unit's size)
        self._new: list[tuple] = []
        self.update(entries)

    def add(self, where: str, images: int, reason: str, of: Optional[int] = None) -> bool:
        """Record ``images`` lost at ``where`` (a unit of ``of`` images, or one image: None);
        True where the place is new."""
        if where in self.entries:
            return False
        self.entries[where] = (int(images), reason, of)
        self._new.append((where, int(images), reason, of))
        return True

    def update(self, entries: Sequence) -> list[tuple]:
        """Add (where, images, reason, of) entries (another process's); those that were new."""
        return [tuple(e) for e in entries if self.add(*e)]

    def take_new(self) -> list[tuple]:
        """The entries added since the last call (what a worker hands over)."""
        new, self._new = self._new, []
        return new

    def to_list(self) -> list[tuple]:
        return [(where, *entry) for where, entry in self.entries.items()]

    @property
    def images(self) -> int:
        return sum(images for images, _, _ in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((where, reason) for where, (_, reason, _) in self.entries.items())

    def units(self) -> list[str]:
        """A line for each unit (shard) that broke off: what a warning says."""
        return [describe_unread(where, *entry) for where, entry in self.entries.items() if entry[2] is not None]


def describe_unread(where: str, images: int, reason: str, of: Optional[int]) -> str:
    """The warning line of one ``Unread`` entry."""
    if of is None:
        return f"{where}: skipped unreadable image ({reason})"
    if images == 0:
        return f"{where}: damaged, though every image it was counted to hold was read ({reason})"
    return f"{where}: {images} of its {of} images could not be read, left out ({reason})"


def unit_name(unit) -> str:
    """How a message names a unit: a shard's path, ``file:index`` of a record batch or row group."""
    return ":".join(map(str, unit)) if isinstance(unit, tuple) else str(unit)


@dataclass(frozen=True)
class StreamSource:
    """A labelled set read unit by unit, never decoded as a whole: tar shards, the record
    batches of a Hugging Face dataset, the row groups of parquet files, chunks of a folder.

    units:      what one reader reads in one go; ``read(unit, skipped)`` yields (key, payload,
                label) in a fixed order: ``payload`` the encoded image (bytes) or its path,
                ``label`` an int, or a tuple of ints for a multi-label sample.  What it leaves
                out (a damaged sample, the rest of a damaged shard) goes to the list
                ``skipped`` as (where, reason), logged by the reader only where that is None.
    unit_sizes: samples per unit (as stored; unreadable ones are left out when read, and
                counted by ``read_counted``).
    classes:    class names in label order.
    name:       the source as the user named it, for messages.
    key:        a string that changes when the data changes: what a decoded copy is
                cached under ("": not cached).
    root:       the folder whose paths its samples' keys are (a folder's, read image by image),
                which a sample's name leaves out (``memory.image_ids``); "": keys are names.
    """

    units: list
    read: Callable[[object], Iterator[tuple[str, object, object]]]
    classes: list[str]
    unit_sizes: list[int]
    name: str = ""
    key: str = ""
    root: str = ""

    @property
    def num_samples(self) -> int:
        return int(sum(self.unit_sizes))

    def read_counted(self, index: int, unread: Optional[Unread] = None) -> Iterator[tuple[str, object, object]]:
        """``read`` of unit ``index``; the images it held but could not hand over (fewer
        samples than ``unit_sizes`` says, or damage) go to ``unread`` (logged where that is None)."""
        unit, size = self.units[index], self.unit_sizes[index]
        skipped: list[tuple[str, str]] = []
        count = 0
        for sample in self.read(unit, skipped):
            count += 1
            yield sample
        if count < size or skipped:
            where = unit_name(unit)
            place, reason = skipped[-1] if skipped else ("", "the unit ended early")
            if place and place != Path(where).name:
                reason = f"{place}: {reason}"
            entry = (where, max(size - count, 0), reason, size)
            if unread is None:
                log.warning(describe_unread(*entry))
            else:
                unread.add(*entry)

    def samples(self, unread: Optional[Unread] = None) -> Iterator[tuple[str, object, object]]:
        """Every (key, payload, label), unit after unit in stored order; what could not be read
        goes to ``unread`` (``read_counted``)."""
        for index in range(len(self.units)):
            yield from self.read_counted(index, unread)

    def subset(self, indices: Sequence[int], part: str) -> "StreamSource":
        """The units at ``indices`` (in that order) as a source of their own, named ``part``."""
        indices = [int(i) for i in indices]
        return StreamSource([self.units[i] for i in indices], self.read, self.classes,
                            [self.unit_sizes[i] for i in indices], name=f"{self.name} ({part})",
                            key=self.key and f"{self.key}-{_short_hash(part + ':' + ','.join(map(str, indices)))}",
                            root=self.root)


def check_label_ids(ids: Sequence[int], classes: Sequence[str], source: str, where: str = "") -> None:
    """That every class id in ``ids`` (a flat sequence of ints) is one of ``classes``: a label past
    the list shows that the list (``index.json``, ``classes.txt``, a ClassLabel's names) is not the
    one the labels were written with, and read under it any label may name another class; it failed
    inside the training step, with a traceback.  ``min``/``max`` first: a streamed run checks every
    micro-batch's labels on the host.

    Raises:
        DataError: naming ``source`` (and ``where``: the sample) and the label.
    """
    count = len(classes)
    if len(ids) and (min(ids) < 0 or max(ids) >= count):
        class_id = next(i for i in ids if not 0 <= i < count)
        raise DataError(f"{source}: {where + ': ' if where else ''}label {class_id} is not one of the "
                        f"{count} classes its labels are read under (ids 0 to {count - 1}); its class list "
                        "(index.json, classes.txt or the ClassLabel's names) is not the one the labels "
                        "were written with")


def classes_beside(folder: Path) -> Optional[list[str]]:
    """Class names from ``classes.txt`` (one a line) or ``classes.json`` in ``folder``, or None
    where neither is there.  ``classes.json`` holds the names in label order, or a mapping of
    the names to their ids (torchvision's ``class_to_idx``) or of the ids to the names (an
    ``id2label``): read as a list, a mapping gave its keys in the file's order, names or ids.

    Raises:
        DataError: the file is not one of those (not UTF-8, not JSON, ids not 0 to N-1), named.
    """
    text, listed = folder / "classes.txt", folder / "classes.json"
    where = text if text.is_file() else listed
    try:
        if where == text:
            return [line.strip() for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
        if listed.is_file():
            return _names_in_order(json.loads(listed.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as e:  # UnicodeDecodeError and json's errors are ValueErrors
        raise DataError(f"{where}: not class names in label order (classes.txt: one a line; classes.json: a list, "
                        f"or a mapping of the names to the ids 0 to N-1, or of the ids to the names): "
                        f"{type(e).__name__}: {e}") from e
    return None


def _names_in_order(found) -> list[str]:
    """The class names of ``classes.json``'s content, in label order."""
    if isinstance(found, dict):
        by_name = all(isinstance(v, int) and not isinstance(v, bool) for v in found.values())
        pairs = [(v, k) if by_name else (k, v) for k, v in found.items()]  # (id, name)
        if not all(str(i).isdigit() for i, _ in pairs) or sorted(int(i) for i, _ in pairs) != list(range(len(pairs))):
            raise ValueError(f"the ids are not 0 to {len(pairs) - 1}")
        found = [name for _, name in sorted((int(i), name) for i, name in pairs)]
    if not isinstance(found, list) or not all(isinstance(name, str) for name in found):
        raise TypeError(f"expected names (strings), found {json.dumps(found)[:60]}")
    return found


def files_key(paths: Sequence[PathLike], name: str = "files", classes: Sequence[str] = ()) -> str:
    """A short string that changes when any of ``paths`` changes (path, size, mtime), or the
    ``classes`` their labels name: those come from a file beside them (``index.json``,
    ``classes.txt``) that can be edited alone, and a decoded copy cached under the key keeps
    the names it was decoded with."""
    digest = hashlib.sha256()
    for path in paths:
        st = os.stat(path)
        digest.update(f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    digest.update(json.dumps(list(classes)).encode())
    return f"{name}-{digest.hexdigest()[:16]}"


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _is_packed(name: str) -> bool:
    """Whether a file named ``name`` is an archive (.tar, .tar.gz, .tgz or .zip): one inside a tree is not opened."""
    return is_archive(name) or name.lower().endswith(".zip")


def _not_data(name: str) -> bool:
    """Whether a file or folder named ``name`` is never data: hidden ones (.DS_Store,
    .ipynb_checkpoints) and the folder of resource forks macOS puts into a zip, which unzipped
    lies beside the tree (read as a class, and as a second top folder, it made every class
    folder of ``train/`` one class)."""
    return name.startswith(".") or name == "__MACOSX"


def not_data_path(relpath: str) -> bool:
    """Whether the relative POSIX path ``relpath`` (a file of a tree, a member of an archive or a
    shard) is or lies in a file or folder that is never data (``_not_data``): ``.DS_Store``, the
    ``._<name>`` resource fork macOS's tar writes before a file, ``__MACOSX/``; a ``.`` part
    (``./a.jpg``) is no folder."""
    return any(_not_data(part) for part in PurePosixPath(relpath).parts)


def _walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` of ``top`` without the folders that are never data, following links to
    folders as torchvision's ImageFolder does (a tree of links to another's class folders is a
    common way to make a subset; unfollowed, each was a class without images); a link to a
    folder above itself, which would loop, is not followed and is warned of."""
    above = {top: frozenset({os.path.realpath(top)})}  # each folder to visit: the real paths down to it
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        seen, kept = above.pop(dirpath), []
        for name in dirnames:
            if _not_data(name):
                continue
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path)
            if real in seen:
                _warn_once(top, 0, f"not following {path}: a link to a folder above it (a loop)")
                continue
            above[path] = seen | {real}
            kept.append(name)
        dirnames[:] = kept
        yield dirpath, dirnames, filenames


def _index_tree(where: str, files: list[str], dirs: list[str],
                meant_empty: Sequence[str] = (), packed: Sequence[str] = ()) -> tuple[str, list[str], np.ndarray, list[str]]:
    """Apply the ImageFolder rules to relative POSIX paths of image files and folders.

    Files directly in the root are ignored; if the root holds exactly one folder, with
    no images directly in it but with sub-folders, that folder is the class root.  A class
    folder without an image is warned of, unless it is one of ``meant_empty`` (folders).
    ``packed``: archives the tree holds (never opened), which a tree of no class folders names.

    Returns (prefix of the class root, image paths sorted by class then path, labels,
    classes).  ``where`` names the tree in error messages.
    """
    first = lambda path: path.split("/", 1)[0]  # noqa: E731
    top = sorted({first(d) for d in dirs} | {first(f) for f in files if "/" in f})
    prefix = ""
    if len(top) == 1:
        inner = top[0] + "/"
        inside = [f[len(inner):] for f in files if f.startswith(inner)]
        has_subfolders = any(d.startswith(inner) for d in dirs) or any("/" in f for f in inside)
        if has_subfolders and not any("/" not in f for f in inside):
            prefix = inner  # e.g. <root>/train/<class>/...
    strip = lambda paths: [p[len(prefix):] for p in paths if p.startswith(prefix) and len(p) > len(prefix)]  # noqa: E731
    class_dirs, class_files = strip(dirs), [f for f in strip(files) if "/" in f]
    classes = sorted({first(d) for d in class_dirs} | {first(f) for f in class_files})
    if not classes:
        # a .tar of the tree packed again into a .tar.gz: refused without a word of the archive inside
        held = (f"; it holds an archive, {packed[0]}, which is not opened: give that archive itself as the data "
                "(a .zip extracted first)") if packed else ""
        raise DataError(f"{where}: no class folders found (expected <root>/<class>/<image>){held}")
    label_of = {c: i for i, c in enumerate(classes)}
    ordered = sorted(class_files, key=lambda f: (label_of[first(f)], f))
    if not ordered:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise DataError(f"{where}: no images found in its {len(classes)} class folders (extensions: {exts})")
    labels = np.asarray([label_of[first(f)] for f in ordered], dtype=np.int64)
    empty = [c for c, n in zip(classes, np.bincount(labels, minlength=len(classes)))
             if n == 0 and prefix + c not in meant_empty]
    if empty:
        _warn_once(where, len(ordered), f"{len(empty)} class folder(s) hold no images: {', '.join(empty[:5])}")
    return prefix, [prefix + f for f in ordered], labels, classes


# What this process has been told of a data tree, by the tree's real path and image count: a
# run lists a folder more than once (its size, its cache key, its decoding), and says each once.
_TOLD: set[tuple[str, int, str]] = set()


def _warn_once(where: str, images: int, what: str) -> None:
    told = (os.path.realpath(where), images, what)
    if told not in _TOLD:
        _TOLD.add(told)
        log.warning("%s: %s", where, what)


# the folders below a tree's class folders (``<class>/<sub>/``) that its last listing found, by the tree's real
# path: their modification times then, and how many times ``listing_state`` has seen one of them change since
_BELOW: dict[str, tuple[dict[str, Optional[int]], int]] = {}


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:  # gone
        return None


def _record_below(root: str, dirs: Sequence[str]) -> None:
    """Note the folders of ``dirs`` (relative to ``root``) that ``listing_state``'s top levels do not cover,
    and their times: a change since the last note is counted as ``listing_state`` counts one (a listing for
    the decoded copy's key, ``source_key``, that found it first left the cached listing as it was)."""
    covered = 2 if sum("/" not in d for d in dirs) == 1 else 1  # the levels listing_state reads
    real = os.path.realpath(root)
    below = {f: _mtime(f) for f in (os.path.join(real, d) for d in dirs if d.count("/") >= covered)}
    if below or real in _BELOW:
        before, changes = _BELOW.get(real, (below, 0))
        _BELOW[real] = (below, changes + (below != before))


def listing_state(source: str) -> tuple:
    """What a per-process cache of ``source``'s listing or count is keyed by besides its
    name, so that a long-lived process (a notebook) sees a changed tree: a file's real path,
    size and modification time; a folder's real path, the modification times of it and of
    its folders one level down (a class folder's changes when an image is added to it or
    removed), or two levels where the folder holds a single one (``train/<class>/``), and
    the size and time of each file directly in it (a shard, a parquet or arrow file, an
    index.json written over in place leaves the folder's time as it was); () for what is
    not a path here (the digits, a pattern of shards: ``vitlab.data.stream.source_state``).
    A folder's state costs one listing of its top levels, not of its images, and a ``stat``
    of each folder below a class folder (``<class>/<sub>/``) that the tree's last listing found
    (``scan_image_folder``): an image added to one or removed from it changes its time alone,
    and the listing cached before (what ``vitlab.data.stream.scan_folder`` and the count read)
    held the images that were there then, where ``source_key`` (the decoded copy's key) lists
    them all again."""
    path = os.path.expanduser(source)
    try:
        st = os.stat(path)
    except OSError:
        return ()
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return (real, st.st_size, st.st_mtime_ns)
    state = [real, st.st_mtime_ns]
    top = real
    for level in range(2):
        with os.scandir(top) as found:
            entries = [e for e in found if not _not_data(e.name)]
        folders = sorted((e.name, e.stat().st_mtime_ns) for e in entries if e.is_dir())
        state.extend(folders)
        if level == 0:
            state.extend(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries
                                if e.is_file()))
        if len(folders) != 1:
            break
        top = os.path.join(top, folders[0][0])
    below, changes = _BELOW.get(real, ({}, 0))
    now = {f: _mtime(f) for f in below}
    if now != below:  # counted, so that the state differs from every one before, the listing's too
        changes += 1
        _BELOW[real] = (now, changes)
    state.append(("below", changes))
    return tuple(state)


def holds_class_images(root: PathLike) -> bool:
    """Whether the folder ``root`` holds an image in a (not hidden) folder below it, what
    ``scan_image_folder`` needs at the least; found without listing the whole tree (the
    walk stops at the first image)."""
    top = os.fspath(root)
    for dirpath, _, filenames in _walk(top):
        if dirpath != top and any(not f.startswith(".") and _is_image(f) for f in filenames):
            return True
    return False


def scan_image_folder(root: PathLike) -> ImageFolderIndex:
    """List an ImageFolder tree: ``root/<class>/<image>`` (images may sit in sub-folders;
    links to folders are followed, hidden folders and ``__MACOSX`` left out).

    ``root`` may also hold exactly one folder (such as ``train/``) that in turn holds
    the class folders, which is how archives are usually packed.

    Raises:
        DataError: ``root`` is not a folder, has no class folders, or has no images.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: not a folder (expected an ImageFolder tree or a .tar/.tar.gz/.tgz archive)")
    files, dirs, ignored, meant_empty, packed = [], [], [], [], []
    for dirpath, dirnames, filenames in _walk(str(root)):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel + "/"
        dirs.extend(rel + d for d in dirnames)
        files.extend(rel + f for f in filenames if not f.startswith(".") and _is_image(f))
        ignored.extend(rel + f for f in filenames if not f.startswith(".") and not _is_image(f) and rel)
        packed.extend(rel + f for f in filenames if not f.startswith(".") and _is_packed(f))
        if EMPTY_CLASS_MARK in filenames:
            meant_empty.append(rel.rstrip("/"))
    prefix, relpaths, labels, classes = _index_tree(str(root), files, dirs, meant_empty, packed)
    _record_below(str(root), dirs)
    if ignored:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        _warn_once(str(root), len(relpaths), f"ignored {len(ignored)} file(s) that are not images by their extension "
                   f"(first: {ignored[0]}; images: {exts})")
    return ImageFolderIndex(
        root=root / prefix if prefix else root,
        paths=[str(root / p) for p in relpaths],
        labels=labels,
        classes=classes,
        ignored=tuple(sorted(ignored)),
    )


def read_image_archive(path: PathLike, limits: ArchiveLimits | None = None) -> tuple[ImageFolderIndex, list[bytes]]:
    """Read a tar archive of an ImageFolder tree in one sequential pass, without extracting.

    Writing 50,000 small files to disk costs more than decoding them, so data sets that
    are decoded into RAM are read straight from the archive.  ``paths`` are
    ``<archive>/<member name>`` (for messages); the encoded bytes come in the same order.
    Same rules and errors as ``scan_image_folder``.  A link (hard or symbolic) to an image
    of the archive is that image, as it is where the archive is extracted (``resolve_data_path``:
    what streaming and ``pack_shards`` read); other links, devices and other special members
    are skipped with a warning, and an archive that is damaged or over ``limits`` (a tar bomb)
    raises ``DataError``.
    """
    path = Path(path)
    blobs, dirs, special, packed = _archive_members(path, limits or ArchiveLimits.from_env(), read=True)
    if special:
        log.warning("%s: skipped %d link/device member(s) (first: %s); only regular files and links to the "
                    "archive's images are read", path, len(special), special[0])
    prefix, relpaths, labels, classes = _index_tree(str(path), list(blobs), dirs, packed=packed)
    index = ImageFolderIndex(
        root=path / prefix if prefix else path,
        paths=[f"{path}/{p}" for p in relpaths],
        labels=labels,
        classes=classes,
    )
    return index, [blobs[p] for p in relpaths]


def _archive_members(path: Path, limits: ArchiveLimits, read: bool
                     ) -> tuple[dict[str, bytes | None], list[str], list[str], list[str]]:
    """One pass over the archive at ``path``: its images by member name, with their bytes where ``read``
    (else None), a link inside the archive to an image being that image; its folders; the members
    skipped (links to no image, devices); the archives it holds (a .tar, .tar.gz, .tgz or .zip: not
    opened).  The one rule of which members are images, the reader's (``read_image_archive``) and the
    count's (``count_archive_images``): each restating it, the count took a link to no image (dangling,
    or to a text file) for one the reader skipped."""
    blobs: dict[str, bytes | None] = {}
    links: dict[str, str] = {}  # an image's name -> the member it links to, resolved after the pass
    dirs: list[str] = []
    budget = _Budget(path, limits)
    special: list[str] = []
    packed: list[str] = []
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                budget.take(member)
                name = _member_name(member)
                if not name or not_data_path(name):
                    continue
                if member.isdir():
                    dirs.append(name)
                elif member.isfile():
                    if _is_image(name):
                        if member.size > budget.limits.member_bytes:
                            raise DataError(f"{path}: member {name!r} declares {member.size} bytes, more than "
                                            f"{budget.limits.member_bytes} for one image (a tar bomb?)")
                        blobs[name] = tar.extractfile(member).read() if read else None
                        links.pop(name, None)  # a later member of a name replaces an earlier one
                    elif _is_packed(name):
                        packed.append(name)
                elif (member.issym() or member.islnk()) and _is_image(name) and _link_inside(member):
                    # a hard link names its target from the archive's root, a symbolic one from its folder
                    target = member.linkname if member.islnk() else posixpath.join(posixpath.dirname(name),
                                                                                   member.linkname)
                    links[name] = posixpath.normpath(target)
                    blobs.pop(name, None)
                else:
                    special.append(name)
    except DataError:
        raise
    except TAR_ERRORS as e:
        raise DataError(f"{path}: not a readable tar archive (truncated or corrupt?): {type(e).__name__}: {e}") from e
    for name, target in links.items():
        for _ in range(len(links)):  # a link to a link: followed to its end (a loop ends nowhere)
            if target not in links:
                break
            target = links[target]
        if target in blobs:
            blobs[name] = blobs[target]
        else:
            special.append(name)
    return blobs, dirs, special, packed


def count_archive_images(path: PathLike) -> int:
    """The images of the archive at ``path`` as ``read_image_archive`` lists them, none read: its
    members by the reader's rule (``_archive_members``) under its tree's (``_index_tree``), so the
    count is the number of samples the reader gives.  Raises ``DataError`` as the reader does."""
    images, dirs, _, packed = _archive_members(Path(path), ArchiveLimits.from_env(), read=False)
    return len(_index_tree(str(path), list(images), dirs, packed=packed)[1])


def _member_name(member: tarfile.TarInfo) -> str:
    """A member's name as the archive's tree has it: no leading ./ nor trailing /."""
    name = member.name
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def _link_inside(member: tarfile.TarInfo) -> bool:
    """Whether a link's target is named inside the archive: not absolute, no '..' (the links
    ``_checked_members`` lets an extraction write)."""
    target = PurePosixPath(member.linkname)
    return not target.is_absolute() and ".." not in target.parts


def default_cache_dir() -> Path:
    """``$VITLAB_CACHE`` if set, else ``~/.cache/vitlab``."""
    env = os.environ.get("VITLAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vitlab"


def is_archive(path: PathLike) -> bool:
    name = str(path).lower()
    return any(name.endswith(s) for s in ARCHIVE_SUFFIXES)


def _archive_stem(path: Path) -> str:
    name = path.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def source_key(path: PathLike) -> str:
    """A short string that changes when the data at ``path`` changes.

    For an archive: its absolute path, size and mtime (one ``stat``).  For a folder:
    the same three facts for every image in it, so adding, removing or rewriting an
    image changes the key (one ``stat`` per image, a fraction of a second for 50k), the
    real path of an image reached through a link (to the image, or to a folder above it),
    and its class names: a class folder without images, added or removed, renumbers the
    classes after it.
    """
    path = Path(path).resolve()
    if path.is_file():
        st = path.stat()
        return f"{_archive_stem(path)}-{_short_hash(f'{path}|{st.st_size}|{st.st_mtime_ns}')}"
    if path.is_dir():
        # surrogateescape: file names that are not UTF-8 hash as their bytes
        digest = hashlib.sha256(str(path).encode("utf-8", "surrogateescape"))
        index = scan_image_folder(path)
        real_folders: dict[str, str] = {}  # each folder of images: its real path, read once
        for image in index.paths:
            try:
                st = os.stat(image)
                facts = f"{st.st_size}|{st.st_mtime_ns}"
            except OSError as e:  # a link to nothing, an image gone: left out when decoded, not the run's end
                facts = type(e).__name__
            # and what a link names: a folder of links (vtab's split views) pointed at other images of the same
            # size and time had the same key, and a new --split-seed was decoded as the cached earlier split; so
            # had a class folder that is a link, pointed at another folder of such images
            if os.path.islink(image):
                target = f"|{os.path.realpath(image)}"
            else:
                folder = os.path.dirname(image)
                real = real_folders.setdefault(folder, os.path.realpath(folder))
                target = f"|{os.path.join(real, os.path.basename(image))}" if real != folder else ""
            digest.update(f"\n{image}|{facts}{target}".encode("utf-8", "surrogateescape"))  # a plain tree's as it was
        digest.update(json.dumps(index.classes).encode("utf-8", "surrogateescape"))
        return f"{path.name}-{digest.hexdigest()[:16]}"
    raise DataError(f"{path}: no such file or folder")


def _checked_members(tar: tarfile.TarFile, archive: Path, budget: _Budget,
                     skipped: list[str]) -> Iterator[tarfile.TarInfo]:
    """Yield the archive's members, refusing any that could write outside the target.

    Device files and FIFOs are skipped (their names go to ``skipped``); the member count
    and declared sizes are held to ``budget``.
    """
    for member in tar:
        budget.take(member)
        parts = PurePosixPath(member.name).parts
        if member.name.startswith(("/", "\\")) or PurePosixPath(member.name).is_absolute() or ".." in parts:
            raise DataError(f"{archive}: refusing member {member.name!r} (absolute path or '..' escapes the target)")
        if member.issym() or member.islnk():
            target = PurePosixPath(member.linkname)
            if target.is_absolute() or ".." in target.parts:
                raise DataError(f"{archive}: refusing link {member.name!r} -> {member.linkname!r}")
        if member.isdev() or member.isfifo():
            skipped.append(member.name)  # never meaningful in a data set
            continue
        yield member


def _extract(archive: Path, target: Path, limits: ArchiveLimits) -> None:
    free = shutil.disk_usage(target).free
    budget = _Budget(archive, limits, free)
    skipped: list[str] = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = _checked_members(tar, archive, budget, skipped)
            if hasattr(tarfile, "data_filter"):
                # The standard library's own safety filter as a second line of defence.
                tar.extractall(target, members=members, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tar.extractall(target, members=members)
    except DataError:
        raise
    except tarfile.FilterError as e:
        raise DataError(f"{archive}: refusing member: {e}") from e
    except TAR_ERRORS as e:
        raise DataError(f"{archive}: not a readable tar archive (truncated or corrupt?): {type(e).__name__}: {e}") from e
    if skipped:
        log.warning("%s: skipped %d device/FIFO member(s) (first: %s)", archive, len(skipped), skipped[0])


def _clean_stale(extracted: Path, name: str) -> None:
    """Remove half-extracted folders of ``name`` whose extracting process is gone (killed)."""
    for partial in extracted.iterdir():
        if not (partial.name.startswith(f".{name}.") and partial.name.endswith(".partial")):
            continue
        pid_text = partial.name[len(name) + 2 :].split(".", 1)[0]
        try:
            pid = int(pid_text)
        except ValueError:
            continue
        if pid != os.getpid() and _alive(pid):
            continue  # another process is extracting right now
        log.warning("%s: removing a half-extracted folder left by a killed run (pid %d)", partial, pid)
        shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def resolve_data_path(path: PathLike, cache_dir: PathLike | None = None,
                      limits: ArchiveLimits | None = None) -> Path:
    """Return a folder holding the data at ``path``.

    A folder is returned as is.  A ``.tar``/``.tar.gz``/``.tgz`` archive is extracted
    once into ``<cache_dir>/extracted/<name>-<key>`` and that folder reused while the
    archive's path, size and mtime are unchanged.

    cache_dir: defaults to ``default_cache_dir()``.
    limits:    what the archive may hold; defaults to ``ArchiveLimits.from_env()``.

    Raises:
        DataError: ``path`` does not exist, is not a folder or a supported archive, the
            archive has a member with an absolute path or ``..`` in it or a link out of
            the target, it is damaged, or it exceeds ``ArchiveLimits`` (a tar bomb).
            Nothing is left in the cache then; device files are skipped with a warning.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        return path
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if not is_archive(path):
        raise DataError(f"{path}: not a folder or a .tar/.tar.gz/.tgz archive")

    extracted = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    extracted = extracted / "extracted"
    final = extracted / source_key(path)
    if final.is_dir():
        return final
    limits = limits or ArchiveLimits.from_env()
    extracted.mkdir(parents=True, exist_ok=True)
    _clean_stale(extracted, final.name)
    # the pid in the name tells a later run whether the extracting process is still alive
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".partial", dir=extracted))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        log.info("extracting %s into %s", path, final)
        _extract(path, tmp, limits)
        try:
            os.rename(tmp, final)  # atomic on one file system: the folder appears complete or not at all
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same extraction first; use its copy.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
