"""A disk that fills up as a named file is written: opening it (or a temporary file beside it,
``.NAME.*``) for writing raises ENOSPC once the file is open, so a file written in place has
already been truncated, as on a real full disk, and one written beside its place is not.  Both
``io.open`` (pathlib, ``os.fdopen``) and the built-in ``open`` are watched."""
from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path


def fill_disk_at(monkeypatch, name: str) -> None:
    real_open = io.open

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        # an fd (os.fdopen of a temporary file) is named by /proc
        path = Path(os.readlink(f"/proc/self/fd/{f.fileno()}"))
        if any(c in mode for c in "wax") and (path.name == name or path.name.startswith(f".{name}.")):
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return f

    monkeypatch.setattr(io, "open", opening)
    monkeypatch.setattr(builtins, "open", opening)
