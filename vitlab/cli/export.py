"""`vitlab export`: write a model as ONNX or as a torch.export program.

    vitlab export runs/x --format onnx          # writes runs/x/model.onnx
    vitlab export runs/x/model.safetensors --out b16.pt2     # a .pt2 suffix: --format torch-export

The class names kept with the weights (a run's ``classes.json``, an export's ``id2label``)
travel into the file: ONNX metadata ``id2label``/``label2id``, or the .pt2's extra files; so
does the input the model reads (``vitlab.export.read_preprocessing``: its size, RGB, NCHW,
``(p / 255 - 0.5) / 0.5`` after a bilinear resize of the whole image, as ``vitlab predict`` does),
and the loss the weights were trained with (a run's ``optim.loss``, the weights' own record), as
Hugging Face's ``problem_type``: a ``sigmoid_xent`` run's outputs are each class's own sigmoid.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.cli import add_img_size_argument, add_weights_arguments, load_weights, weights_read, without_untrained_head


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="CHECKPOINT_OR_MODEL_NAME",
                   help="weights (file or directory, any format `vitlab` reads, or a Hugging Face Hub name) "
                        "or a registry name (random weights, e.g. to measure speed)")
    p.add_argument("--format", choices=("onnx", "torch-export"), default=None,
                   help="default: the one --out's suffix names (.onnx, .pt2), else onnx")
    p.add_argument("--out", default=None,
                   help="output file (default: model.onnx / model.pt2 in the checkpoint's folder; for a registry "
                        "name, the name in this folder)")
    add_img_size_argument(p, "input resolution the export takes")
    p.add_argument("--batch", default="dynamic",
                   help="'dynamic' (any batch, the default) or a fixed batch size")
    add_weights_arguments(p, "weights given as the source")
    p.add_argument("--check", action="store_true",
                   help="run the exported model on random images and compare with PyTorch")


SUFFIXES = {"onnx": ".onnx", "torch-export": ".pt2"}
# files vitlab reads as weights: an export written there would be taken for weights, and over the
# source itself it replaced the weights it was made from
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".pt", ".pth", ".bin")


def default_out(source: str, fmt: str) -> Path:
    """Where the export goes without ``--out``: beside the weights, or ``<registry name>.onnx`` here."""
    suffix = SUFFIXES[fmt]
    path = Path(source)
    if path.is_dir():
        return path / f"model{suffix}"
    if path.exists():
        return path.with_suffix(suffix)
    return Path(source.replace("/", "-") + suffix)  # ViT-B/16 -> ViT-B-16.onnx


def format_and_out(fmt: str | None, out: str | None, source: str) -> tuple[str, Path]:
    """The format and the output file, each taken from the other where it is not given: an
    export named as the other format's file (an ONNX model in m.pt2) would be opened as what it is not."""
    suffix = Path(out).suffix.lower() if out else None
    named = next((f for f, ending in SUFFIXES.items() if ending == suffix), None)
    if suffix in WEIGHT_SUFFIXES:
        raise ValueError(f"--out={out!r}: a {suffix} file is read as weights, not as an export; "
                         "name it .onnx or .pt2")
    if fmt is not None and named not in (None, fmt):
        raise ValueError(f"--out={out!r}: --format {fmt} writes a {SUFFIXES[fmt]} file ({suffix} is {named}'s); "
                         f"name it {SUFFIXES[fmt]}, or leave --format out")
    fmt = fmt or named or "onnx"  # a suffix of neither format says nothing: the documented default
    return fmt, Path(out) if out else default_out(source, fmt)


def _load(args: argparse.Namespace):
    from vitlab.models.registry import canonical_name, create_model, list_models, unknown_model

    source, name, img_size = args.source, args.name, args.img_size
    if _is_weights(source):  # a run of masked patch prediction: its encoder's features, without its untrained head
        model, note = without_untrained_head(source, load_weights(args, source))
        if note is not None:
            print(note)
        return model
    if name is not None:  # it was ignored: the registry name given as the source is the model
        raise ValueError(f"--name={name!r}: names the model of weights whose shapes do not give it; {source!r} "
                         "is a registry name already")
    if canonical_name(source) not in list_models():  # a folder mistyped (runs/dem) was "unknown model" alone
        raise ValueError(f"{source}: no such file or folder, and {unknown_model(source)}")
    read = [f"--{key.replace('_', '-')}" for key in weights_read(args)]  # --num-heads, --weights-img-size
    if read:  # as --name: ignored, the model a registry name builds at --img-size
        raise ValueError(f"{', '.join(read)}: how weights that do not record their model are read; {source!r} "
                         "is a registry name, whose random weights are built at --img-size")
    return create_model(source, **({"img_size": img_size} if img_size else {}))


def _class_names(source: str, num_classes: int) -> list[str] | None:
    """The class names kept with weights (None for a registry name's random model), one per class of the
    head: names of another count were refused as the library's argument "class_names", naming no file."""
    from vitlab.weights import WeightsError
    from vitlab.weights.load import read_class_names

    names = read_class_names(source) if _is_weights(source) and num_classes else None  # a model without a head: none
    if names is not None and len(names) != num_classes:
        raise WeightsError(f"{source}: its {len(names)} class names do not match the {num_classes} classes of its "
                           "head (a classes.json from another run?)")
    return names


def _loss(source: str, num_classes: int) -> str | None:
    """The loss the weights were trained with, as their run or they themselves record it (None for a
    registry name's random model, for weights that record none, and for a model without a head)."""
    from vitlab.analysis.report import read_run_meta, recorded_loss

    return recorded_loss(read_run_meta(source), default=None) if _is_weights(source) and num_classes else None


def _is_weights(source: str) -> bool:
    """Whether ``source`` names weights (a path, a Hugging Face name, a weights file or a path in a folder here
    that is not there: no such file, not an unknown registry name) rather than a registry name."""
    from vitlab.weights.hub import local_folder, parse_hub_name

    path = Path(source)
    return (path.exists() or parse_hub_name(source) is not None or local_folder(source) is not None
            or path.suffix.lower() in WEIGHT_SUFFIXES)


def run(args: argparse.Namespace) -> int:
    from vitlab.config import need_output_file
    from vitlab.export import export_onnx, export_program, model_img_size, require_onnx_packages
    from vitlab.extras import require
    from vitlab.weights.native import need_outside_run

    if args.batch != "dynamic" and not (args.batch.isdigit() and int(args.batch) > 0):
        raise ValueError(f"--batch={args.batch!r}: expected 'dynamic' or a positive integer")
    dynamic = args.batch == "dynamic"
    fmt, out = format_and_out(args.format, args.out, args.source)
    need_output_file("--out", out)  # before the model is loaded and traced
    need_outside_run("--out", out, beside=tuple(SUFFIXES.values()))  # not over a run's config.json
    if fmt == "onnx":  # before the model is loaded (downloaded, maybe) and the file written, which stayed
        require_onnx_packages()
        if args.check:
            require("onnxruntime", "--check of an ONNX export")
    model = _load(args).eval()
    size = model_img_size(model, args.img_size)
    batch = 2 if dynamic else int(args.batch)
    names, loss = _class_names(args.source, model.cfg.num_classes), _loss(args.source, model.cfg.num_classes)
    export = export_onnx if fmt == "onnx" else export_program
    export(model, out, size, dynamic_batch=dynamic, batch=batch, class_names=names, loss=loss)
    mb = out.stat().st_size / 2**20
    print(f"wrote {out} ({fmt}, {mb:.1f} MiB, input (B, C, {size[0]}, {size[1]}), "
          f"batch {'dynamic' if dynamic else args.batch})")
    if args.check:
        print(f"max |exported - pytorch| = {check(model, out, fmt, batch, size):.2e}")
    return 0


def check(model, out: Path, fmt: str, batch: int, size: tuple[int, int]) -> float:
    """The largest difference between the exported model's logits and the model's on random images."""
    import torch

    from vitlab.export import load_program
    from vitlab.extras import require

    x = torch.randn(batch, model.cfg.in_chans, *size)
    with torch.no_grad():
        ref = model(x)
        if fmt == "onnx":
            ort = require("onnxruntime", "--check of an ONNX export")  # run asked before the export
            session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
            got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        else:
            got = load_program(out)(x)
    return (got - ref).abs().max().item()
