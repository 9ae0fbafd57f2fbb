"""`vitlab finetune`: adapt pre-trained weights to a new data set (paper Sec. 3.2).

    vitlab finetune --recipe paper_finetune:dataset=cifar10 --init ViT-B_16.npz \\
        --data cifar10-train.tar.gz --img-size 384 --val-split 0.02

The weights (official .npz, Hugging Face, timm or vitlab's own) are loaded with
``vitlab.weights.load_model``: position embeddings are interpolated to ``--img-size``
and the head is replaced by a zero-initialised one for the new classes (the
pre-logits layer is dropped unless ``--set model.keep_pre_logits=true``).  Like `train`, it
ends by printing one JSON line with the final metrics and the weights' path.
"""
from __future__ import annotations

import argparse
import json

from .train import add_common_arguments, resolve_config, run_training, show_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--init", required=True,
                   help="pre-trained weights: .npz, .safetensors, a vitlab run folder or a Hugging Face Hub name "
                        "(org/name); a registry name is a model, not weights (train it with `vitlab train --model`)")
    add_common_arguments(p, default_recipe="paper_finetune", helps={
        "img_size": "fine-tuning resolution; the init's position embeddings are interpolated to its patch grid"})


def run(args: argparse.Namespace) -> int:
    from vitlab.train.build import check_can_run
    from vitlab.train.distributed import env_world_size

    cfg = resolve_config(args, extra={"model.init": args.init})
    if args.show_config:  # no processes, no decoded data; the data counted and the init's config read
        show_config(cfg)
        return 0
    check_can_run(cfg, env_world_size())
    summary = run_training(cfg, args)
    if summary.get("weights") is not None:
        print(json.dumps(summary), flush=True)
    return 0
