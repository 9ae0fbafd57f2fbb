"""`vitlab pack-shards`: an ImageFolder tree (or archive of one) into tar shards.

    vitlab pack-shards imagenet/train shards/imagenet-train --per-shard 2000
    vitlab pack-shards imagenet/train shards/imagenet-512 --max-side 512 --quality 90   # resized, as FFCV stores it
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="ImageFolder folder or .tar/.tar.gz archive of one")
    p.add_argument("out", help="empty output folder for shard-000000.tar ... and index.json")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed of the packing order")
    p.add_argument("--max-side", type=int, default=None, metavar="N",
                   help="shrink images whose longer side exceeds N pixels to N (stored as JPEG at --quality): "
                        "smaller files that decode faster; e.g. 512 for training at 224")
    p.add_argument("--quality", type=int, default=None, metavar="Q",
                   help="JPEG quality 1-100 of re-encoded images (default 90 with --max-side); given alone, every "
                        "image is re-encoded")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that re-encode (default: every core)")
    p.add_argument("--cache-dir", help="where archives are extracted")


def run(args: argparse.Namespace) -> int:
    from vitlab.data.shards import pack_shards
    from vitlab.machine import usable_cores

    workers = usable_cores() if args.workers is None else args.workers
    shards = pack_shards(args.source, args.out, args.per_shard, seed=args.seed, cache_dir=args.cache_dir,
                         max_side=args.max_side, quality=args.quality, workers=workers)
    print(f"{len(shards)} shard(s) in {args.out} (index: {args.out}/index.json)")
    return 0
