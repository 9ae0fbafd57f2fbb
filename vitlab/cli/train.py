"""`vitlab train`: train a model with a recipe from ``vitlab/configs/``.

    vitlab train --recipe cifar10_scratch --data ../shared/data/cifar10/cifar10-train.tar.gz \\
        --val-split 5000 --time-limit 30
    torchrun --nproc_per_node=8 -m vitlab train --recipe paper_pretrain --model ViT-B/16 \\
        --data 'shards/{000000..000999}.tar' --val-split 0 --accum-steps 4

Every ``TrainConfig`` field can be changed with ``--set section.field=value`` (``--set
optim.lr=0.01``; ``--set model.width=256`` for a ViTConfig field; the flat names of
earlier versions, ``--set lr=0.01``, still work); the dedicated flags below are shortcuts.  The
command ends by printing one JSON line: the final metrics and the weights' path.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vitlab.cli import add_img_size_argument, add_weights_img_size_argument
from vitlab.config import PRECISIONS
from vitlab.fast import FP8_SCALINGS

# flag -> TrainConfig field
SHORTCUTS = {
    "model": "model.name", "data": "data.source", "val_split": "data.val_split", "time_limit": "run.time_limit",
    "steps": "optim.steps", "batch_size": "optim.batch_size", "lr": "optim.lr", "out": "run.out",
    "precision": "run.precision", "accum_steps": "optim.accum_steps", "seed": "run.seed", "img_size": "model.img_size",
    "fsdp": "run.fsdp", "compile": "run.compile", "fast": "run.fast", "retain_freed_memory": "run.retain_freed_memory",
    "stream": "data.stream", "val_data": "data.val_data", "fp8": "run.fp8",
    "weights_img_size": "model.weights_img_size",
}


def add_common_arguments(p: argparse.ArgumentParser, default_recipe: str | None,
                         helps: dict[str, str] | None = None) -> None:
    """Flags shared by train, finetune and sweep; ``helps``: a command's own help of a flag, by its dest."""
    helps = helps or {}
    p.add_argument("--recipe", default=default_recipe, required=default_recipe is None,
                   help="a recipe of vitlab/configs/ (NAME or NAME:key=value or path/to/recipe.py)")
    p.add_argument("--model", help="registry name, e.g. ViT-B/16 (see `vitlab models`)")
    p.add_argument("--data", help="ImageFolder folder, .tar/.tar.gz archive of one, 'digits', or a set to stream: "
                                  "tar shards (a folder of them, 'shards/{000000..000099}.tar' or 'shards/*.tar'), a "
                                  "Hugging Face save_to_disk folder or parquet files")
    p.add_argument("--stream", choices=("auto", "memory", "stream"),
                   help="decode the training set into memory or stream it from disk in DataLoader workers "
                        "(default auto: shards, Hugging Face datasets and parquet files stream; a folder streams "
                        "when decoded it would exceed data.memory_limit_gb)")
    p.add_argument("--val-split", type=float,
                   help=helps.get("val_split", "held-out validation examples: a count (5000) or a fraction (0.1); 0: "
                                               "none (a streamed set holds out whole shards)"))
    p.add_argument("--val-data", help=helps.get("val_data", "a separate validation set, in any form --data takes "
                                                            "(then no held-out split)"))
    p.add_argument("--time-limit", type=float, metavar="MINUTES",
                   help=helps.get("time_limit", "fit warm-up, decay and the final evaluation into this wall-clock "
                                                "budget"))
    p.add_argument("--steps", type=int, help="optimiser steps (the ceiling under --time-limit)")
    p.add_argument("--batch-size", type=int, help="global batch size")
    p.add_argument("--accum-steps", type=count_or_auto,
                   help="gradient accumulation: micro-batches per step, or auto (the fewest whose micro-batch fits in "
                        "memory: measured on a GPU, estimated on a CPU; the run's config.json records the number)")
    p.add_argument("--lr", type=float, help=helps.get("lr", "base learning rate"))
    add_img_size_argument(p, helps.get("img_size", "training resolution"), "the recipe's, else the model's")
    add_weights_img_size_argument(p, "the init's weights (model.init)")
    p.add_argument("--precision", choices=("auto", *PRECISIONS),
                   help="auto: bf16 autocast where it is faster than fp32 (GPUs; CPUs whose bf16 matmul kernel beats the fp32 GEMM), else fp32; fp16: autocast with a gradient scaler (run.loss_scale); fp8 matmuls: --fp8")
    p.add_argument("--fp8", choices=("off", *FP8_SCALINGS),
                   help="the encoder blocks' dense layers in fp8, scaled per tensor or per row, the rest in bf16 "
                        "(needs --precision bf16 or auto and a GPU of compute capability 8.9+: H100, H200, L4, RTX 40; "
                        "torchao's arithmetic instead of vitlab's: --set run.fp8_backend=torchao)")
    add_run_arguments(p, helps)


def add_run_arguments(p: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
    """How the run is carried out: seed, output, arithmetic, resuming, overrides."""
    helps = helps or {}
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help=helps.get("out", "output folder (metrics, checkpoints, weights)"))
    p.add_argument("--fsdp", action="store_true", default=None, help="shard the model with FSDP (multi-process)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    add_fast_argument(p)
    p.add_argument("--retain-freed-memory", action="store_true", default=None,
                   help="CPU: let malloc keep freed memory for the next step (process-wide; "
                        "see vitlab/train/memory.py)")
    p.add_argument("--resume", action="store_true", help=helps.get("resume", "continue from the newest intact checkpoint in OUT/checkpoints (a --time-limit run keeps its clock); under torchrun --max-restarts a restarted group resumes by itself"))
    p.add_argument("--overwrite", action="store_true",
                   help=helps.get("overwrite", "start afresh in an OUT that holds an earlier run: its checkpoints, "
                                               "weights and summary are deleted as the new run starts"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any TrainConfig field, SECTION.FIELD=VALUE (repeatable); model.FIELD=VALUE for a "
                        "ViTConfig field")
    p.add_argument("--show-config", action="store_true",
                   help=helps.get("show_config", "print the resolved config as JSON, with the run's estimated peak "
                                                 "memory (memory_estimate), and exit"))
    p.add_argument("--quiet", action="store_true", help="no progress line")


def count_or_auto(text: str) -> int | str:
    """An argparse type: a positive integer, or "auto"."""
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer or auto")
    return int(text)


def show_config(cfg) -> None:
    """--show-config: the config as the run would state it, how its "auto" settings resolve
    on this machine and its memory estimate, as one JSON object (``vitlab.train.resolve.preview``).  Under
    torchrun every process checks it (a refusal is each one's) and rank 0 alone prints it: each printed it."""
    from vitlab.train.distributed import env_rank
    from vitlab.train.resolve import preview

    shown = preview(cfg)
    if env_rank() == 0:
        print(json.dumps(shown, indent=2))


def add_fast_argument(p: argparse.ArgumentParser) -> None:
    """``--no-fast``, shared by train, finetune, eval and predict."""
    p.add_argument("--no-fast", dest="fast", action="store_false", default=None,
                   help="run the plain model, without vitlab.fast.optimize (the results are the same weights)")


def process_started_at() -> float:
    """When this process started, on the ``time.monotonic()`` clock (Linux; elsewhere: now).

    A ``--time-limit`` budget is the command's wall time, so it counts the seconds spent
    importing PyTorch before ``train`` is reached (~2 s here) as well.
    """
    now = time.monotonic()
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # fields 3.. of proc(5)
        start_ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0.0 <= age < 3600.0 else now  # a nonsensical age (odd /proc): no correction


def resolve_config(args: argparse.Namespace, extra: dict | None = None):
    """Recipe -> --set overrides -> dedicated flags (the most specific wins); a recipe whose rates are
    per model (Table 3) takes the named model's, else the init's (``load_recipe``'s changes)."""
    from vitlab.configs import load_recipe

    return load_recipe(args.recipe, changes=config_changes(args, extra)[1])


def config_changes(args: argparse.Namespace, extra: dict | None = None):
    """(the recipe, the changes ``resolve_config`` makes to it: --set's, the flags' and ``extra``)."""
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import parse_overrides

    cfg = load_recipe(args.recipe, model_name=getattr(args, "model", None))  # what --set's values are read against
    changes = parse_overrides(cfg, args.overrides)  # checked together with the flags' changes, below
    changes.update({field: getattr(args, flag) for flag, field in SHORTCUTS.items()
                    if getattr(args, flag, None) is not None})
    split = changes.get("data.val_split")
    if isinstance(split, float) and split.is_integer() and split >= 1:  # other types: the config names them
        changes["data.val_split"] = int(split)
    changes.update(extra or {})
    return cfg, changes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, default_recipe=None)


def run(args: argparse.Namespace) -> int:
    from vitlab.train.build import check_can_run
    from vitlab.train.distributed import env_world_size

    cfg = resolve_config(args)  # the config checks its values as it is built
    if args.show_config:  # no processes, no decoded data; the data counted and an init's config read
        show_config(cfg)
        return 0
    check_can_run(cfg, env_world_size())  # the machine's side, before any data is read
    summary = run_training(cfg, args)
    if summary.get("weights") is not None:  # rank 0 of a distributed run
        print(json.dumps(summary), flush=True)
    return 0


def run_training(cfg, args: argparse.Namespace) -> dict:
    """train's and finetune's run of ``cfg``; Ctrl-C says what --resume goes on from (``resume_advice``):
    "go on from where it stopped" was said of a run that had written no checkpoint (the demo's
    run.ckpt_every=0), whose --resume trained it again from step 0."""
    from vitlab.train import train
    from vitlab.train.loop import resume_advice

    try:
        return train(cfg, resume=args.resume, overwrite=args.overwrite, verbose=not args.quiet,
                     started_at=process_started_at())
    except KeyboardInterrupt:
        raise KeyboardInterrupt(resume_advice(cfg)) from None
