"""Training checkpoints: written atomically, checked on reading, the last k kept.

A checkpoint is one ``torch.save`` file, ``<dir>/ckpt-<step>.pt``, holding whatever state
dict the loop hands over (model, optimiser, EMA, step, RNG states, data position).  It is
written to a temporary file in the same folder, flushed and fsync'ed, then renamed over
the final name, and the folder is fsync'ed: a crash at any moment leaves either the old
set of checkpoints or the new one, never a truncated file under a checkpoint's name.
Only then are checkpoints beyond the newest ``keep`` removed, so with ``keep >= 2`` the
previous checkpoint is still there when the newest is found damaged.

A write that fails (a full disk) removes its temporary file and raises
``CheckpointError`` naming the last good checkpoint, which it left untouched.  A write
killed outright leaves its temporary file behind; ``remove_partial_writes`` clears it.

The checksum: ``torch.save``'s zip format records a CRC-32 of every entry (the pickle and
each tensor's bytes), which ``torch.load`` does not check.  ``damage`` checks them all,
so a truncated file or a flipped bit is found before the state is used, and
``load_latest_intact`` falls back to the previous checkpoint.
"""
from __future__ import annotations

import errno
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from vitlab.files import atomic_write

PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")
PARTIAL_PATTERN = re.compile(r"^\.ckpt-\d+\.pt\..*\.tmp$")  # the temporary file of an unfinished write
DAMAGED_SUFFIX = ".damaged"


class CheckpointError(OSError):
    """A checkpoint that could not be written, or no intact checkpoint to resume from."""


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


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` so that it is the old file or the new one (``atomic_write``:
    a temporary file beside it, fsynced, renamed over it, with a new file's mode)."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(state: dict, folder: str | os.PathLike, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and keep only the newest ``keep``.

    A failed write raises ``CheckpointError`` (an ``OSError``) naming the file, the cause
    and the last good checkpoint, which is left as it was."""
    path = checkpoint_path(folder, step)
    previous = latest_checkpoint(folder)
    try:
        save_atomic(state, path)
    except OSError as err:
        cause = "no space left on the device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        kept = f"the last good checkpoint, {previous}, is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write the checkpoint of step {step} to {path}: {cause}; {kept}; "
                              "free space and continue with --resume") from err
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def remove_partial_writes(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of writes that were killed before their rename; returns them.

    Only one process (rank 0 of one run) writes into a run's checkpoint folder, so at the
    start of a run every such file is an orphan."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    partial = [folder / name for name in sorted(os.listdir(folder)) if PARTIAL_PATTERN.match(name)]
    for path in partial:
        path.unlink(missing_ok=True)
    return partial


def damage(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not an intact checkpoint (truncated, a CRC-32 mismatch), or None."""
    try:
        if not zipfile.is_zipfile(path):
            return "not a complete zip archive: truncated or overwritten"
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except OSError as err:  # unreadable (gone, permissions, I/O error)
        return f"unreadable: {err.strerror or err}"
    except Exception as err:  # noqa: BLE001 - BadZipFile, zlib.error, EOFError, ...: damaged
        return f"not a readable zip archive: {err}"
    return f"entry {bad!r} fails its CRC-32 checksum" if bad is not None else None


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state saved in ``path``, its checksums checked first (``CheckpointError`` if damaged)."""
    problem = damage(path)
    if problem is not None:
        raise CheckpointError(f"{path} is damaged: {problem}")
    # Our own files: they hold numpy/python RNG states, which weights_only refuses.
    return torch.load(path, map_location="cpu", weights_only=False)


def load_latest_intact(folder: str | os.PathLike) -> tuple[Path | None, dict | None, list[tuple[Path, str]]]:
    """The newest checkpoint of ``folder`` that passes its checksums, loaded:
    (path, state, [(damaged newer checkpoint, why), ...]); (None, None, damaged) if none
    is intact or there is none.  Changes nothing on disk."""
    damaged = []
    for path in reversed(list_checkpoints(folder)):
        problem = damage(path)
        if problem is None:
            try:
                return path, torch.load(path, map_location="cpu", weights_only=False), damaged
            except Exception as err:  # noqa: BLE001 - checksums right but the pickle unreadable: damaged too
                problem = f"torch.load failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        damaged.append((path, problem))
    return None, None, damaged


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged``: kept for inspection, out of the
    rotation (it no longer counts among the ``keep`` newest)."""
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    os.replace(path, target)
    return target
