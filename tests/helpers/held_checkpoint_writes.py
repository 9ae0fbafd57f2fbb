"""``python -m vitlab`` with every checkpoint write held open for a while between
``torch.save`` and the rename, so that a kill can be aimed inside a write (kill_resume.py):

    python tests/helpers/held_checkpoint_writes.py SECONDS train --recipe demo ...
    torchrun --nproc_per_node=2 tests/helpers/held_checkpoint_writes.py SECONDS train ...

vitlab itself has no such hook: this process alone swaps the ``torch`` that
``vitlab.train.checkpoint`` saves with for one whose ``save`` waits after writing.  A group that
torchrun started again (after a kill) writes at once: no kill is aimed at its writes.
"""
from __future__ import annotations

import os
import sys
import time

import torch


class HeldSaves:
    """``torch`` as ``vitlab.train.checkpoint`` sees it, but ``save`` keeps the written file
    open ``seconds`` longer, before the checkpoint's flush, fsync and rename."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def save(self, obj, f, *args, **kwargs) -> None:
        torch.save(obj, f, *args, **kwargs)
        time.sleep(self.seconds)


def main(argv: list[str]) -> int:
    from vitlab.cli import main as vitlab
    from vitlab.train import checkpoint

    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        checkpoint.torch = HeldSaves(float(argv[0]))
    return vitlab(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
