"""Fixtures for the data tests: tiny synthetic ImageFolder trees written to tmp dirs.

Every image encodes its own id in its first pixels (PNG is lossless), so tests can tell
which example came out of a stream without trusting file names.
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
from PIL import Image


def image_with_id(image_id: int, size: tuple[int, int] = (8, 8)) -> np.ndarray:
    """(H, W, 3) uint8 image whose pixel (0, 0) holds image_id in base 256 (R low, G high)."""
    rng = np.random.default_rng(image_id)
    array = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    array[0, 0, 0], array[0, 0, 1] = image_id % 256, image_id // 256
    return array


def id_of(image_chw) -> int:
    """Inverse of image_with_id for a decoded (3, H, W) tensor or array."""
    return int(image_chw[0, 0, 0]) + 256 * int(image_chw[1, 0, 0])


@pytest.fixture
def make_folder(tmp_path: Path) -> Callable[..., Path]:
    """make_folder(classes=3, per_class=4, size=(8, 8), fmt="png", subdir=None) -> root.

    Class ``c`` is named ``class_c``; image ids run 0..N-1 in class-then-file order.
    """
    counter = {"n": 0}

    def make(classes=3, per_class=4, size=(8, 8), fmt="png", subdir=None, name=None) -> Path:
        counter["n"] += 1
        root = tmp_path / (name or f"folder{counter['n']}")
        base = root / subdir if subdir else root
        image_id = 0
        counts = [per_class] * classes if isinstance(per_class, int) else list(per_class)
        for c, n in enumerate(counts):
            (base / f"class_{c}").mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(image_with_id(image_id, size)).save(base / f"class_{c}" / f"{i:04d}.{fmt}")
                image_id += 1
        return root

    return make


def make_tar(folder: Path, archive: Path) -> Path:
    """Pack ``folder``'s contents (not the folder itself) into a .tar/.tar.gz archive."""
    mode = "w:gz" if archive.name.endswith((".gz", ".tgz")) else "w"
    with tarfile.open(archive, mode) as tar:
        for child in sorted(folder.iterdir()):
            tar.add(child, arcname=child.name)
    return archive


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def fakes() -> SimpleNamespace:
    """The helpers above, for tests (fixtures keep them importable under any import mode)."""
    return SimpleNamespace(image_with_id=image_with_id, id_of=id_of, make_tar=make_tar, add_bytes=add_bytes)
