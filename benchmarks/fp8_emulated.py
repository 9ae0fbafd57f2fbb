"""fp8's training arithmetic against bf16's on a CPU, at the same steps: a first reading of
"fp8 must still train" before a GPU measures it.

    python benchmarks/fp8_emulated.py --data ../shared/data/cifar10/cifar10-train.tar.gz
    python benchmarks/fp8_emulated.py --data ../shared/data/cifar10/cifar10-train.tar.gz --steps 200 \
        --variants bf16,tensorwise,torchao-tensorwise,rowwise

Each variant trains the CIFAR recipe's plain ViT as ``vitlab train`` builds it on this CPU
(``--recipe``, bf16 autocast, eager) for ``--steps`` steps with the same seed, so the same
initial weights, batches and augmentations: the runs differ in the encoder blocks' dense
layers alone, computed in bf16 or in fp8 (``run.fp8``, by vitlab's arithmetic or torchao's,
``run.fp8_backend``).  The trainer refuses fp8 on a CPU, whose ``torch._scaled_mm`` only
emulates fp8 tensor cores (slowly: about 3.5x bf16's step here); this script lifts that
refusal for its own runs and puts it back.  It reads accuracy, not speed.

Per variant: the held-out top-1 (one view, the mirror pair, the recipe's 10 views), the final
training loss, and the training loss's largest gap to bf16's over the logged steps (each
record averages ``--log-every`` steps).  One JSON line last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from vitlab.configs import load_recipe
from vitlab.train import train
from vitlab.train import resolve as resolve_module
from vitlab.train.metrics import read_jsonl
from vitlab.train.overrides import apply_overrides, with_changes

BACKEND_PREFIX = "torchao-"


@contextlib.contextmanager
def fp8_on_this_cpu():
    """``resolve.check_fp8`` set aside inside, put back on leaving (the emulated product)."""
    refusal = resolve_module.check_fp8
    resolve_module.check_fp8 = lambda *args: None
    try:
        yield
    finally:
        resolve_module.check_fp8 = refusal


def variant_changes(variant: str) -> dict:
    """The run fields of a variant: "bf16", or an fp8 scaling with "torchao-" for torchao's arithmetic."""
    if variant == "bf16":
        return {"run.fp8": "off"}
    backend = "torchao" if variant.startswith(BACKEND_PREFIX) else "vitlab"
    return {"run.fp8": variant.removeprefix(BACKEND_PREFIX), "run.fp8_backend": backend}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="cifar10_scratch:model=vit,device=cpu")
    p.add_argument("--data", default=None, help="the recipe's data.source (default: the recipe's own)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--variants", default="bf16,tensorwise,torchao-tensorwise",
                   help="comma-separated: bf16 (the reference, first), tensorwise, rowwise, torchao-tensorwise, "
                        "torchao-rowwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="as vitlab train --set")
    p.add_argument("--out", default="/tmp/fp8-emulated")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    allowed = {"bf16", "tensorwise", "rowwise", "torchao-tensorwise", "torchao-rowwise"}
    if not args.variants or args.variants[0] != "bf16" or not set(args.variants) <= allowed:
        p.error(f"--variants {','.join(args.variants)}: bf16 first, then some of {', '.join(sorted(allowed - {'bf16'}))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = {"run.time_limit": 0.0, "optim.steps": args.steps, "run.seed": args.seed, "run.precision": "bf16",
            "run.device": "cpu", "run.log_every": args.log_every, "run.tensorboard": False, "run.ckpt_every": 0}
    if args.data:
        base["data.source"] = args.data
    rows = []
    for variant in args.variants:
        out = Path(args.out) / variant
        cfg = apply_overrides(with_changes(load_recipe(args.recipe), base | variant_changes(variant) |
                                           {"run.out": str(out)}), args.set)
        with fp8_on_this_cpu():
            summary = train(cfg, overwrite=True, verbose=False)
        losses = {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}
        single, flip = summary.get("val_top1_single"), summary.get("val_top1_flip")
        rows.append({"variant": variant, "val_top1": summary["val_top1"], "val_top1_single": single,
                     "val_top1_flip": flip, "train_loss": summary["train_loss"], "losses": losses,
                     "wall_s": summary["wall_s"]})
        print(f"{variant}: top-1 {summary['val_top1']:.4f} (one view {single}, mirror pair {flip}), final "
              f"training loss {summary['train_loss']:.4f}, {summary['wall_s']:.0f} s", flush=True)
    reference = rows[0]["losses"]
    for row in rows:
        gaps = [abs(loss - reference[step]) / reference[step] for step, loss in row.pop("losses").items()
                if step in reference]
        row["largest_loss_gap"] = max(gaps) if gaps else None
        row["top1_minus_bf16"] = row["val_top1"] - rows[0]["val_top1"]
    print("| variant | top-1 (10 views) | against bf16 | one view | mirror pair | final training loss "
          "| largest gap to bf16's loss |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['val_top1']:.2%} | {row['top1_minus_bf16']:+.2%} | {row['val_top1_single']} "
              f"| {row['val_top1_flip']} | {row['train_loss']:.4f} | {row['largest_loss_gap']:.1%} |")
    print(json.dumps({"recipe": args.recipe, "steps": args.steps, "seed": args.seed, "sets": args.set,
                      "variants": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
