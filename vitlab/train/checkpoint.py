"""Training checkpoints: written atomically, the last k kept, found again on ``--resume``.

A checkpoint is one ``torch.save`` file, ``<dir>/ckpt-<step>.pt``, holding whatever state
dict the loop hands over (model, optimiser, EMA, step, RNG states, data position).  It is
written to a temporary file in the same folder, flushed and fsync'ed, then renamed over
the final name, and the folder is fsync'ed: a crash or a full disk at any moment leaves
either the old set of checkpoints or the new one, never a truncated file under a
checkpoint's name.  Only then are checkpoints beyond the newest ``keep`` removed.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    return Path(folder) / f"ckpt-{step:08d}.pt"


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), folder / name) for name in os.listdir(folder) if (m := PATTERN.match(name))]
    return [path for _, path in sorted(found)]


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` via temp file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def save_checkpoint(state: dict, folder: str | os.PathLike, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and keep only the newest ``keep``."""
    path = save_atomic(state, checkpoint_path(folder, step))
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict:
    # Our own files: they hold numpy/python RNG states, which weights_only refuses.
    return torch.load(path, map_location="cpu", weights_only=False)
