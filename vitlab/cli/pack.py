"""`vitlab pack-shards`: an ImageFolder tree (or archive of one) into tar shards.

    vitlab pack-shards imagenet/train shards/imagenet-train --per-shard 2000
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="ImageFolder folder or .tar/.tar.gz archive of one")
    p.add_argument("out", help="empty output folder for shard-000000.tar ... and index.json")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed of the packing order")
    p.add_argument("--cache-dir", help="where archives are extracted")


def run(args: argparse.Namespace) -> int:
    from vitlab.data.shards import pack_shards

    shards = pack_shards(args.source, args.out, args.per_shard, seed=args.seed, cache_dir=args.cache_dir)
    print(f"{len(shards)} shard(s) in {args.out} (index: {args.out}/index.json)")
    return 0
