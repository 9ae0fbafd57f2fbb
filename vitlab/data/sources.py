"""Where images come from: ImageFolder trees and tar archives of them.

``scan_image_folder`` lists an ImageFolder tree (``<root>/<class>/<image>``) into paths
and integer labels, classes sorted by name as torchvision's ImageFolder sorts them, so
label ids agree with other code that reads the same folder.

``resolve_data_path`` turns a ``.tar``/``.tar.gz``/``.tgz`` archive into a folder by
extracting it once into a cache.  The cache key is cheap (absolute path, size, mtime),
so a second call costs one ``stat``; the extraction lands in a temporary folder that
is renamed into place only when complete, so a killed run never leaves a half folder
that a later run would mistake for a finished one.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Union

import numpy as np

__all__ = [
    "DataError",
    "ImageFolderIndex",
    "IMAGE_EXTENSIONS",
    "scan_image_folder",
    "read_image_archive",
    "resolve_data_path",
    "default_cache_dir",
    "is_archive",
    "source_key",
]

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"})
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class DataError(ValueError):
    """Data that cannot be used as asked: missing, empty, malformed or unsafe."""


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

    def __len__(self) -> int:
        return len(self.paths)

    def counts(self) -> np.ndarray:
        """(num_classes,) int64 number of images per class."""
        return np.bincount(self.labels, minlength=len(self.classes))


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _hidden(relpath: str) -> bool:
    # Hidden files and folders (.DS_Store, .ipynb_checkpoints) are never data.
    return any(part.startswith(".") for part in relpath.split("/"))


def _index_tree(where: str, files: list[str], dirs: list[str]) -> tuple[str, list[str], np.ndarray, list[str]]:
    """Apply the ImageFolder rules to relative POSIX paths of image files and folders.

    Files directly in the root are ignored; if the root holds exactly one folder, with
    no images directly in it but with sub-folders, that folder is the class root.

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
        raise DataError(f"{where}: no class folders found (expected <root>/<class>/<image>)")
    label_of = {c: i for i, c in enumerate(classes)}
    ordered = sorted(class_files, key=lambda f: (label_of[first(f)], f))
    if not ordered:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise DataError(f"{where}: no images found in its {len(classes)} class folders (extensions: {exts})")
    labels = np.asarray([label_of[first(f)] for f in ordered], dtype=np.int64)
    empty = [c for c, n in zip(classes, np.bincount(labels, minlength=len(classes))) if n == 0]
    if empty:
        log.warning("%s: %d class folder(s) hold no images: %s", where, len(empty), ", ".join(empty[:5]))
    return prefix, [prefix + f for f in ordered], labels, classes


def scan_image_folder(root: PathLike) -> ImageFolderIndex:
    """List an ImageFolder tree: ``root/<class>/<image>`` (images may sit in sub-folders).

    ``root`` may also hold exactly one folder (such as ``train/``) that in turn holds
    the class folders, which is how archives are usually packed.

    Raises:
        DataError: ``root`` is not a folder, has no class folders, or has no images.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: not a folder (expected an ImageFolder tree or a .tar/.tar.gz/.tgz archive)")
    files, dirs = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel + "/"
        dirs.extend(rel + d for d in dirnames)
        files.extend(rel + f for f in filenames if not f.startswith(".") and _is_image(f))
    prefix, relpaths, labels, classes = _index_tree(str(root), files, dirs)
    return ImageFolderIndex(
        root=root / prefix if prefix else root,
        paths=[str(root / p) for p in relpaths],
        labels=labels,
        classes=classes,
    )


def read_image_archive(path: PathLike) -> tuple[ImageFolderIndex, list[bytes]]:
    """Read a tar archive of an ImageFolder tree in one sequential pass, without extracting.

    Writing 50,000 small files to disk costs more than decoding them, so data sets that
    are decoded into RAM are read straight from the archive.  ``paths`` are
    ``<archive>/<member name>`` (for messages); the encoded bytes come in the same order.
    Same rules and errors as ``scan_image_folder``.
    """
    path = Path(path)
    blobs: dict[str, bytes] = {}
    dirs: list[str] = []
    with tarfile.open(path, "r:*") as tar:
        for member in tar:
            name = member.name
            while name.startswith("./"):
                name = name[2:]
            name = name.rstrip("/")
            if not name or _hidden(name):
                continue
            if member.isdir():
                dirs.append(name)
            elif member.isfile() and _is_image(name):
                blobs[name] = tar.extractfile(member).read()
    prefix, relpaths, labels, classes = _index_tree(str(path), list(blobs), dirs)
    index = ImageFolderIndex(
        root=path / prefix if prefix else path,
        paths=[f"{path}/{p}" for p in relpaths],
        labels=labels,
        classes=classes,
    )
    return index, [blobs[p] for p in relpaths]


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
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_key(path: PathLike) -> str:
    """A short string that changes when the data at ``path`` changes.

    For an archive: its absolute path, size and mtime (one ``stat``).  For a folder:
    the same three facts for every image in it, so adding, removing or rewriting an
    image changes the key (one ``stat`` per image, a fraction of a second for 50k).
    """
    path = Path(path).resolve()
    if path.is_file():
        st = path.stat()
        return f"{_archive_stem(path)}-{_short_hash(f'{path}|{st.st_size}|{st.st_mtime_ns}')}"
    if path.is_dir():
        digest = hashlib.sha256(str(path).encode())
        for image in scan_image_folder(path).paths:
            st = os.stat(image)
            digest.update(f"\n{image}|{st.st_size}|{st.st_mtime_ns}".encode())
        return f"{path.name}-{digest.hexdigest()[:16]}"
    raise DataError(f"{path}: no such file or folder")


def _checked_members(tar: tarfile.TarFile, archive: Path) -> Iterator[tarfile.TarInfo]:
    """Yield the archive's members, refusing any that could write outside the target."""
    for member in tar:
        parts = PurePosixPath(member.name).parts
        if member.name.startswith(("/", "\\")) or PurePosixPath(member.name).is_absolute() or ".." in parts:
            raise DataError(f"{archive}: refusing member {member.name!r} (absolute path or '..' escapes the target)")
        if member.issym() or member.islnk():
            target = PurePosixPath(member.linkname)
            if target.is_absolute() or ".." in target.parts:
                raise DataError(f"{archive}: refusing link {member.name!r} -> {member.linkname!r}")
        if member.isdev() or member.isfifo():
            continue  # never meaningful in a data set
        yield member


def _extract(archive: Path, target: Path) -> None:
    with tarfile.open(archive, "r:*") as tar:
        members = _checked_members(tar, archive)
        if hasattr(tarfile, "data_filter"):
            # The standard library's own safety filter as a second line of defence.
            tar.extractall(target, members=members, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(target, members=members)


def resolve_data_path(path: PathLike, cache_dir: PathLike | None = None) -> Path:
    """Return a folder holding the data at ``path``.

    A folder is returned as is.  A ``.tar``/``.tar.gz``/``.tgz`` archive is extracted
    once into ``<cache_dir>/extracted/<name>-<key>`` and that folder reused while the
    archive's path, size and mtime are unchanged.

    cache_dir: defaults to ``default_cache_dir()``.

    Raises:
        DataError: ``path`` does not exist, is not a folder or a supported archive, or
            the archive has a member with an absolute path or ``..`` in it.
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
    extracted.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=extracted))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        log.info("extracting %s into %s", path, final)
        _extract(path, tmp)
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
