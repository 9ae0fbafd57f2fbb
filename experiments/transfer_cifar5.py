"""Transfer in miniature: moved to ``vitlab experiment transfer`` (vitlab/experiments/transfer.py).

    vitlab experiment transfer --data ../shared/data/cifar10/cifar10-train.tar.gz --seeds 1 \\
        --set pretrain_minutes=10 --set finetune_minutes=5
    vitlab experiment transfer --quick

This script forwards its arguments there.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from vitlab.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["experiment", "transfer", *sys.argv[1:]]))
