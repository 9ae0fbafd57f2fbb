"""CIFAR-10 from its official source, converted to an ImageFolder tree of PNGs.

Run only when a user asks for it: it downloads 163 MB.  The python version of the data
set is a tarball of pickled batches: ``data`` is (N, 3072) uint8 with the 1024 red,
then green, then blue values of each 32x32 image in row-major order; ``labels`` are
ints into ``batches.meta``'s ``label_names``.

The result, ``<dest>/cifar10/{train,test}/<class>/<nnnnn>.png``, is what
``load_in_memory`` and ``scan_image_folder`` read.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from vitlab.data.sources import MAX_MEMBER_BYTES, TAR_ERRORS, DataError, PathLike

__all__ = ["download_cifar10", "verify_md5", "convert_cifar_python", "CIFAR10_URL", "CIFAR10_MD5"]

log = logging.getLogger(__name__)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)


def verify_md5(path: PathLike, md5: str) -> None:
    """Check ``path``'s MD5; on a mismatch delete the file and raise DataError."""
    path = Path(path)
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != md5.lower():
        path.unlink()
        raise DataError(
            f"{path}: MD5 {digest.hexdigest()} does not match the expected {md5}; the corrupt file was "
            "deleted, run again to download it afresh"
        )


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a pickle can run any code otherwise."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise DataError(f"refusing to unpickle {module}.{name}: not part of a CIFAR batch")
        return super().find_class(module, name)


def _load_pickle(data: bytes) -> dict:
    try:
        obj = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - UnpicklingError, EOFError, ValueError ... from damaged bytes
        raise DataError(f"a CIFAR batch cannot be unpickled (truncated or corrupt?): {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict):
        raise DataError(f"a CIFAR batch holds a {type(obj).__name__}, not a dict")
    return obj


def _class_names(meta: dict) -> list[str]:
    """``label_names`` as folder names, refusing any that could leave the output folder."""
    names = meta.get(b"label_names")
    if not isinstance(names, list) or not names:
        raise DataError("batches.meta: label_names must be a non-empty list of names")
    out = []
    for raw in names:
        name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise DataError(f"batches.meta: label name {raw!r} cannot be a folder name (allowed: no '/', '\\', "
                            "NUL, '.' or '..')")
        out.append(name)
    if len(set(out)) != len(out):
        raise DataError(f"batches.meta: label names repeat: {out}")
    return out


def _write_split(batches: list[dict], classes: list[str], folder: Path) -> int:
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
    n = 0
    for batch in batches:
        try:
            images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            labels = [int(label) for label in batch[b"labels"]]
        except (KeyError, ValueError, TypeError) as e:
            raise DataError(f"a CIFAR batch lacks (N, 3072) uint8 'data' or integer 'labels': {type(e).__name__}: {e}") from e
        if len(labels) != len(images) or any(not 0 <= label < len(classes) for label in labels):
            raise DataError(f"a CIFAR batch has {len(labels)} labels for {len(images)} images, or a label outside "
                            f"0..{len(classes) - 1}")
        for image, label in zip(images, labels):
            Image.fromarray(image).save(folder / classes[label] / f"{n:05d}.png")
            n += 1
    return n


def convert_cifar_python(archive: PathLike, out: PathLike) -> Path:
    """Convert the python-version tarball to ``out/{train,test}/<class>/<nnnnn>.png``.

    Files are numbered in the order of the batches.  The tree is built in a temporary
    folder and renamed to ``out`` when complete.

    Raises:
        DataError: a batch or ``batches.meta`` is missing from the archive, or ``out`` exists.
    """
    out = Path(out)
    if out.exists():
        raise DataError(f"{out}: already exists; remove it to convert again")
    members: dict[str, bytes] = {}
    wanted = {*TRAIN_BATCHES, *TEST_BATCHES, "batches.meta"}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if member.isfile() and os.path.basename(member.name) in wanted:
                    if member.size > MAX_MEMBER_BYTES:
                        raise DataError(f"{archive}: {member.name} declares {member.size} bytes (a tar bomb?)")
                    members[os.path.basename(member.name)] = tar.extractfile(member).read()
    except DataError:
        raise
    except TAR_ERRORS as e:
        raise DataError(f"{archive}: not a readable tar archive (truncated or corrupt?): {type(e).__name__}: {e}") from e
    missing = [n for n in (*TRAIN_BATCHES, *TEST_BATCHES, "batches.meta") if n not in members]
    if missing:
        raise DataError(f"{archive}: not the CIFAR-10 python tarball (missing {', '.join(missing)})")
    classes = _class_names(_load_pickle(members["batches.meta"]))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        for split, names in (("train", TRAIN_BATCHES), ("test", TEST_BATCHES)):
            count = _write_split([_load_pickle(members[n]) for n in names], classes, tmp / split)
            log.info("CIFAR-10 %s: %d images", split, count)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def download_cifar10(dest: PathLike, *, url: str = CIFAR10_URL, md5: str = CIFAR10_MD5) -> Path:
    """Download, verify and convert CIFAR-10; return ``dest/cifar10`` (train/ and test/).

    Does nothing that is already done: an existing ``dest/cifar10`` is returned as is,
    and a tarball already in ``dest`` with the right MD5 is not downloaded again.

    Raises:
        DataError: the download does not match ``md5`` (the file is deleted).
    """
    dest = Path(dest)
    out = dest / "cifar10"
    if out.is_dir():
        return out
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / url.rsplit("/", 1)[-1]
    if not archive.exists():
        partial = archive.with_name(archive.name + ".partial")
        log.info("downloading %s", url)
        with urllib.request.urlopen(url) as response, open(partial, "wb") as f:
            shutil.copyfileobj(response, f, length=1 << 20)
        os.replace(partial, archive)
    verify_md5(archive, md5)
    return convert_cifar_python(archive, out)
