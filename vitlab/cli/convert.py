"""`vitlab convert`: read weights in any layout vitlab loads, write them in vitlab's, vit_jax's,
Hugging Face's or timm's (``vitlab.weights.save_model``), with a check that the logits agree.

The source's class names (a run's ``classes.json``, an export's ``id2label``) go wherever
the layout has a place for them (``vitlab.weights.labels``), unless ``--num-classes``
gives the model a new head; so does the loss it was trained with (a run's ``optim.loss``, the
weights' own record), which says what its outputs are probabilities of: a ``sigmoid_xent`` run's
are each class's own sigmoid, Hugging Face's ``problem_type`` "multi_label_classification"."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from vitlab.cli import add_img_size_argument, add_weights_arguments, load_weights, without_untrained_head


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="weights: vit_jax/AugReg/big_vision/BiT .npz, Hugging Face directory or file, "
                                  "timm or vitlab state dict (.safetensors, .pth, .bin)")
    p.add_argument("out", help="output: a directory (vitlab, hf), an .npz (official) or a .safetensors/.pth file (timm)")
    p.add_argument("--to", dest="format", choices=("vitlab", "official", "hf", "timm"), default="vitlab",
                   help="layout to write (default: vitlab)")
    add_img_size_argument(p, "resize the position embeddings to this input resolution", "the weights' own")
    add_weights_arguments(p)
    p.add_argument("--num-classes", type=int, default=None,
                   help="a new zero-initialised head with this many classes, where the head has another count "
                        "(the same count keeps the trained head, its class names and loss)")
    p.add_argument("--no-check", action="store_true",
                   help="skip reading the written file back and comparing logits on random images")


# The file suffixes each layout writes ("" for a folder), and those it must not be given: another
# layout's file, which a folder of that name would be mistaken for.
OUT_SUFFIXES = {"vitlab": ("", ".safetensors"), "hf": ("",), "official": (".npz",),
                "timm": ("", ".safetensors", ".pth", ".bin", ".pt")}
WEIGHT_FILE_SUFFIXES = (".npz", ".safetensors", ".pth", ".bin", ".pt")


def check_out(out: str, layout: str) -> None:
    """Refuse an output path whose suffix names a file of another layout (``--to timm`` into ``x.npz``),
    a folder that holds a training run (``save_model`` refuses it too, after the source is read), and a file
    in one (its model.safetensors: the run saves its own weights there through ``save_model``)."""
    from vitlab.weights.native import need_model_folder, need_outside_run

    suffix = Path(out).suffix.lower()
    allowed = OUT_SUFFIXES[layout]
    if suffix in allowed or (suffix not in WEIGHT_FILE_SUFFIXES and "" in allowed):
        need_model_folder(out, layout)
        if suffix in WEIGHT_FILE_SUFFIXES:
            need_outside_run("out", out)
        return
    files = [s for s in allowed if s]
    parts = ["a folder"] if "" in allowed else []
    if files:
        parts.append(f"a {', '.join(files[:-1])} or {files[-1]} file" if len(files) > 1 else f"a {files[0]} file")
    raise ValueError(f"out={out!r}: --to {layout} writes {', or '.join(parts)}")


def run(args: argparse.Namespace) -> int:
    from vitlab.analysis.report import read_run_meta, recorded_loss
    from vitlab.config import need_output_file, need_output_folder
    from vitlab.weights import WeightsError, read_class_names, save_model

    check_out(args.out, args.format)  # before the source is read, which can take a while
    if Path(args.out).suffix.lower() in WEIGHT_FILE_SUFFIXES:
        need_output_file("out", args.out)
    else:
        need_output_folder("out", args.out)
    model, new_head = with_head_to_write(args, load_weights(args, args.source))
    cfg = model.cfg
    names = None if new_head else read_class_names(args.source)  # a new head's classes are not the source's
    if names is not None and len(names) != cfg.num_classes:
        raise WeightsError(f"{args.source}: its {len(names)} class names do not match the {cfg.num_classes} "
                           "classes of its head (a classes.json from another run?)")
    # a new head is untrained: what its outputs are probabilities of is the fine-tuning's to say
    loss = None if new_head else recorded_loss(read_run_meta(args.source), default=None)
    written = save_model(model, args.out, format=args.format, class_names=names, loss=loss)
    print(f"wrote {written} ({args.format}) from {args.source}: {cfg.name or type(model).__name__}")
    if names and args.format == "official":
        print(f"the {len(names)} class names are not written: an official .npz (vit_jax, big_transfer) holds "
              "arrays only")
    if loss == "sigmoid_xent" and args.format in ("official", "timm"):
        print(f"its loss, sigmoid_xent, is not written: {args.format}'s files have no place for it; its outputs "
              "are each class's own sigmoid probability, where a reader takes a softmax")
    if npz_size(cfg, args.format) is not None:
        h, w = cfg.img_size
        print(f"an official .npz records no image size: read {written} with --weights-img-size {h}x{w} "
              f"(load_model's weights_img_size={cfg.img_size})")
    if not args.no_check:
        print(json.dumps({"check": "read back by vitlab", "max_abs_logit_diff": read_back(model, written, args)}))
    return 0


def with_head_to_write(args: argparse.Namespace, model):
    """``model`` with the head to write, and whether that head is new (untrained: the source's class names and
    loss are not its).  A new zero head only for another count, as load_model(num_classes=) gives it; the same
    count keeps the trained head, and with it its names and loss (they were dropped as a new head's, a
    sigmoid_xent run's taken for a softmax's).  A run of masked patch prediction trained no classifier: it is
    written without a head, or with the new one --num-classes asks for (``without_untrained_head``)."""
    from vitlab.weights.core import with_new_head

    model, note = without_untrained_head(args.source, model, args.num_classes)
    if note is not None:
        print(note if args.num_classes else f"{note}; --num-classes N gives it a new one")
        return model, True
    if args.num_classes is not None and args.num_classes != model.cfg.num_classes:
        return with_new_head(model, args.num_classes), True
    return model, False


def read_back(model, written: Path, args: argparse.Namespace) -> float:
    """The largest difference between the logits of ``model`` and of the file written from it, read back:
    hf through its config.json, timm through its .timm.json, an .npz at its size (``npz_size``)."""
    import torch

    from vitlab.weights import load_model

    size = npz_size(model.cfg, args.format)
    again = load_model(args.out if args.format == "hf" else written, **({"weights_img_size": size} if size else {}))
    x = torch.randn(2, model.cfg.in_chans, *model.cfg.img_size)
    with torch.no_grad():
        return (again(x) - model(x)).abs().max().item()


def npz_size(cfg, layout: str) -> tuple[int, int] | None:
    """The resolution a ViT written as an official .npz must be read at, where the arrays do not give it: a
    non-square grid (the loader takes a square one, or refuses; 8x32's 2x8 patches counted a 4x4 grid), of a
    non-square image or of non-square patches (16 px of 4x8 patches: 4x2)."""
    from vitlab.config import ViTConfig

    if layout != "official" or not isinstance(cfg, ViTConfig) or cfg.grid_size[0] == cfg.grid_size[1]:
        return None
    return cfg.img_size
