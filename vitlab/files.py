"""Writing a file so that a crash, a full disk or Ctrl-C leaves the old file or the new one.

    atomic_write(path, lambda f: f.write(data))   # the one writer of every file vitlab replaces

The bytes go to a temporary file beside ``path`` (``.NAME.<random>.tmp``, with the mode a new file
gets), are flushed and fsynced, take the mode of the file they replace, and are renamed over it; the
folder is fsynced so that the rename survives a power cut.  If anything fails, ``write`` included,
the temporary file is removed and the file that was there is as it was.  A file written in place
was truncated as it was opened, so a failure half way (a full disk) left a cut-short file where the
finished one had been, which the next command read as damaged or as nothing.  A write killed
outright (SIGKILL, a power cut) leaves its temporary file; ``remove_temporaries`` clears a folder's.

This module imports nothing of vitlab: every layer (``fast``, ``analysis``, ``weights``, ``train``)
writes through it.  ``weights.core.atomic_write_set`` replaces several files as one set on top of it.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence


def new_temporary(path: Path) -> tuple[int, str]:
    """A new, empty temporary file beside ``path`` (open for writing), with the mode ``open``
    gives a new file (0666 less the umask): ``tempfile.mkstemp``'s is 0600 whatever the umask,
    and the file renamed into place kept it, unreadable to a group the folder is shared with.
    Its name is drawn afresh for each write: a fixed one was written by two writers at once (two
    processes, another host's where the folder is shared), and one renamed the other's half-written
    file into place."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")  # the form remove_temporaries matches
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), str(tmp)
        except FileExistsError:  # another write's name: draw again
            continue


def remove_temporaries(folder: str | os.PathLike, names: Sequence[str]) -> list[Path]:
    """Delete the temporary files of writes of ``folder``/NAME, for each NAME of ``names``, that were
    killed before their rename (SIGKILL, a power cut: nothing could remove them); returns them.
    Only this writer's names match (``.NAME.<12 hex digits>.tmp``), so no other file goes; the
    caller is the one writer of those files in ``folder`` (a run's rank 0 of its records)."""
    folder = Path(folder)
    if not folder.is_dir() or not names:
        return []
    pattern = re.compile(rf"\.(?:{'|'.join(map(re.escape, names))})\.[0-9a-f]{{12}}\.tmp")
    left = [folder / name for name in sorted(os.listdir(folder)) if pattern.fullmatch(name)]
    for path in left:
        path.unlink(missing_ok=True)
    return left


def write_temporary(path: Path, write: Callable[[BinaryIO], Any]) -> str:
    """``write(f)``'s bytes in a fsynced temporary file beside ``path`` (removed if anything fails),
    with the permissions of the file it will replace, else a new file's (``new_temporary``); the
    caller renames it into place (``atomic_write``) or removes it."""
    # checked here, not left to the OS: its errors name the temporary file, which the caller never asked for
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; expected a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.copymode(path, tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def sync_folder(folder: Path) -> None:
    """Make renames in ``folder`` durable; not possible on every platform."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Write a file through ``write(f)`` (a binary file) so that ``path`` is either the old file or the new one.

    The bytes go to a temporary file in the same folder, are fsynced, and the file is renamed
    over ``path`` (atomic on POSIX and Windows), keeping the mode of the file it replaces (a new
    file's: 0666 less the umask).  If anything fails, including ``write`` itself, the temporary
    file is removed and an existing ``path`` is untouched.  ``path``'s folder is made if it does
    not exist.  Returns ``path``."""
    path = Path(path)
    tmp = write_temporary(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write`` of ``text`` in UTF-8."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))
