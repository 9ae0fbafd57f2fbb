"""A run that diverged, on record in its folder: the error it stopped on and the config it was run with.

A protocol that trains a grid of learning rates (``sweep.run_sweep``, ``vtab.run_vtab``) counts a
rate whose run diverged (``numerics.NonFiniteError``) as lost, and stops on a final run that diverged.  Its
record (``DIVERGED_NAME``) lets a later ``resume`` count it lost again (stop on it again) rather than train it
to the same end; a run of another config there is trained, and a run trained again drops the earlier record.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from vitlab.files import atomic_write

from .config import TrainConfig, to_dict
from .numerics import NonFiniteError
from .overrides import with_changes
from .resolve import recorded_paths

__all__ = ["DIVERGED_NAME", "diverged_before", "record_divergence", "forget_divergence", "unless_diverged",
           "finished_unless_diverged"]

# in a rate's run folder, once its run diverged: the error it stopped on and the config it was run with
DIVERGED_NAME = "diverged.json"


def _as_recorded(cfg: TrainConfig) -> dict:
    """``cfg`` as ``DIVERGED_NAME`` holds it: its paths absolute (another spelling of the same data is
    the same run), as JSON reads it back."""
    return json.loads(json.dumps(to_dict(with_changes(cfg, recorded_paths(cfg)))))


def diverged_before(cfg: TrainConfig) -> str | None:
    """The error on which a run of exactly ``cfg`` stopped in its folder (``DIVERGED_NAME``), or None: no
    record, an unreadable one, or one of another config (a setting changed since, which may not diverge)."""
    try:
        record = json.loads((Path(cfg.run.out) / DIVERGED_NAME).read_text())
        return str(record["error"]) if record["config"] == _as_recorded(cfg) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_divergence(cfg: TrainConfig, error: NonFiniteError) -> None:
    """``DIVERGED_NAME`` in ``cfg``'s run folder (by rank 0 of a distributed launch)."""
    if int(os.environ.get("RANK", "0")) == 0:
        text = json.dumps({"error": str(error), "config": _as_recorded(cfg)}, indent=2).encode()
        atomic_write(Path(cfg.run.out) / DIVERGED_NAME, lambda f: f.write(text))


def forget_divergence(cfg: TrainConfig) -> None:
    """Remove an earlier run's ``DIVERGED_NAME`` from ``cfg``'s run folder, as its run is trained now (by rank 0)."""
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(cfg.run.out) / DIVERGED_NAME).unlink(missing_ok=True)


def unless_diverged(cfg: TrainConfig, run: Callable[[], dict], resume: bool, say: Callable[[str], object],
                    label: str) -> tuple[dict | None, str | None]:
    """(``run()``'s summary, None) for a rate's run of ``cfg``; (None, its error) where it diverges (the
    record written) or, with ``resume``, where a run of this config diverged before (not run again: it was
    trained to the same end, from its last checkpoint or from scratch).  ``say`` hears
    ``"LABEL: diverged ..."`` either way."""
    before = diverged_before(cfg) if resume else None
    if before is not None:
        say(f"{label}: diverged before ({Path(cfg.run.out) / DIVERGED_NAME}), counted as lost")
        return None, before
    forget_divergence(cfg)  # trained now: an earlier run's record goes
    try:
        return run(), None
    except NonFiniteError as err:
        record_divergence(cfg, err)
        say(f"{label}: diverged (a loss or gradients not finite), counted as lost")
        return None, str(err)


def finished_unless_diverged(cfg: TrainConfig, run: Callable[[], dict], resume: bool, say: Callable[[str], object],
                             label: str, stops: str) -> dict:
    """``run()``'s summary of a run the protocol cannot go on without (its final run), on record as a
    rate's is (``unless_diverged``); ``NonFiniteError`` "``stops``: its error" where it diverges now or,
    with ``resume``, where a run of this config diverged before."""
    summary, error = unless_diverged(cfg, run, resume, say, label)
    if summary is None:
        raise NonFiniteError(f"{stops}: {error}")
    return summary
