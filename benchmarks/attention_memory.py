"""Peak memory of the attention analyses on a large ViT: ``model_attention_distance`` of
ViT-L/16 at 384 px (L = 577 tokens, 24 layers of 16 heads), random weights and images.

    python benchmarks/attention_memory.py [IMAGES]   (default 16, the function's batch)

Prints, in GiB, the process's peak resident set once the model is built and after the call
(``ru_maxrss``), and the sum of the distances (the same on every revision of the analyses).
A memory figure, not a speed one: the machine's load does not change it.
"""
from __future__ import annotations

import argparse
import resource

import torch

from vitlab.analysis.attention import model_attention_distance
from vitlab.models import create_model


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="?", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = create_model("ViT-L/16", img_size=384)
    images = torch.rand(args.images, 3, 384, 384) * 2 - 1
    built = peak_gib()
    distances = model_attention_distance(model, images)
    print(f"images {args.images}: peak {built:.2f} GiB built, {peak_gib():.2f} GiB after; "
          f"distances sum {distances.sum():.6f}")


if __name__ == "__main__":
    main()
