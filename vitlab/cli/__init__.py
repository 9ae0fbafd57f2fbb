"""The `vitlab` command: the only place that parses argv.

Each subcommand lives in its own module of this package with two functions,
``add_arguments(parser)`` and ``run(args) -> int``.  Modules import heavy things
inside ``run`` so that ``vitlab --help`` stays fast.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings

import vitlab

# (command, module, one-line help)
COMMANDS: list[tuple[str, str, str]] = [
    ("models", "models", "list the registered models with parameters and GFLOPs"),
    ("demo", "demo", "train a small ViT on a bundled dataset in about a minute"),
    ("train", "train", "train a model with a recipe from vitlab/configs/ (one process or many under torchrun)"),
    ("finetune", "finetune", "fine-tune pre-trained weights at a new resolution with a new head"),
    ("predict", "predict", "top-5 classes of images with a trained model"),
    ("sweep", "sweep", "pick the learning rate on a held-out part (the paper's per dataset), then retrain on the "
                       "full training set"),
    ("pack-shards", "pack", "pack an ImageFolder into tar shards for streaming"),
    ("flops", "flops", "forward FLOPs of a model and the compute of a training run"),
    ("export", "export", "export a model to ONNX or a torch.export program"),
    ("convert", "convert", "convert weights between layouts: vitlab, official .npz, Hugging Face, timm"),
    ("eval", "eval", "top-1/top-5, per-class accuracy, confusion and calibration of a checkpoint"),
    ("fewshot", "fewshot", "linear few-shot accuracy of frozen features (closed-form least squares)"),
    ("vtab", "vtab", "the VTAB-1k protocol over a folder of tasks: per-task lr on 800/200, then all 1000, "
                     "group means"),
    ("inspect", "inspect", "an HTML report: attention rollout and distance, embedding figures, training curves"),
    ("experiment", "experiment", "the paper's experiments in miniature: tables and figures into results/NAME"),
    ("calibrate", "calibrate", "time whole training and inference steps of the plain and fast models once and "
                               "store what wins"),
]


def image_size(text: str) -> int | tuple[int, int]:
    """An argparse type: a positive size in pixels, N or HxW (or H,W); every command's --img-size."""
    from vitlab.config import SIZE_FORMS, parse_size

    size = parse_size(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {SIZE_FORMS}")
    return size


def add_img_size_argument(p: argparse.ArgumentParser, what: str, default: str = "the model's") -> None:
    """``--img-size``, one form for every command that takes it: its type, metavar and wording."""
    p.add_argument("--img-size", type=image_size, default=None, metavar="N|HxW",
                   help=f"N (square) or HxW pixels, e.g. 384 or 384x512: {what} (default: {default})")


def positive_count(text: str) -> int:
    """An argparse type: an integer >= 1, refused as the arguments are read (0 was refused by the
    batching once the data set had been decoded, by its library name batch_size)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def add_weights_arguments(p: argparse.ArgumentParser, whose: str = "the weights") -> None:
    """How weights that do not record all of their model are read, one set of flags with one meaning for
    every command that reads weights (``load_weights``): the heads (``--name``, ``--num-heads``) and the
    training resolution (``--weights-img-size``).  Without them eval, predict, inspect and fewshot could
    not read a state dict or a timm file that `convert` reads, nor read a 2x8 grid as anything but 4x4."""
    p.add_argument("--name", default=None,
                   help=f"registry name, e.g. ViT-B/16: the heads of {whose} where their shapes do not give them (a "
                        "state dict, a timm file without its .timm.json); weights that record their model must be "
                        "that one")
    p.add_argument("--num-heads", type=positive_count, default=None, help="attention heads, instead of --name")
    add_weights_img_size_argument(p, whose)


def add_weights_img_size_argument(p: argparse.ArgumentParser, whose: str = "the weights") -> None:
    """``--weights-img-size``, one form and one meaning wherever weights are read (``add_weights_arguments``;
    a fine-tune's init: ``model.weights_img_size``): where weights do not record the resolution they were
    trained at, their patch count alone gave the grid, and a 2x8 one of 16 patches was read as 4x4."""
    p.add_argument("--weights-img-size", type=image_size, default=None, metavar="N|HxW",
                   help=f"the resolution {whose} were trained at, N or HxW pixels, where they do not record it (an "
                        "official or big_vision .npz, a state dict, a timm file without its .timm.json): their "
                        "patch count alone gives a square grid, so a 2x8 one (16 patches) needs it (default: the "
                        "size the weights record, else a square grid)")


def weights_read(args: argparse.Namespace) -> dict:
    """How a command's ``add_weights_arguments`` read its weights: ``load_model``'s keywords, those given."""
    read = {"name": args.name, "num_heads": args.num_heads, "weights_img_size": args.weights_img_size}
    return {key: value for key, value in read.items() if value is not None}


def load_weights(args: argparse.Namespace, source, **kw):
    """``vitlab.weights.load_model`` of the weights a command was given, at its ``--img-size`` (None: their
    own) and read by its ``add_weights_arguments``: the one place those flags reach the library."""
    from vitlab.weights import load_model

    return load_model(source, img_size=args.img_size, **weights_read(args), **kw)


def without_untrained_head(source, model, num_classes: int | None = None):
    """``model`` and None; or, where ``source`` is a run of masked patch prediction (``model.mpp`` of its recorded
    config), which trains no classifier and saves its ViT with the head it was built with (zero), ``model``
    with a new zero head of ``num_classes`` (None or 0: none, the encoder's features) and the line that says
    so.  Written out as it was (convert, export), that head gave every image the same scores under the run's
    class names, where predict and eval refuse the run itself."""
    from vitlab.analysis.report import read_run_meta
    from vitlab.train.legacy import recorded_section
    from vitlab.weights.core import with_new_head

    mpp = recorded_section(read_run_meta(source).get("recipe"), "model").get("mpp")
    if mpp is None:
        return model, None
    written = f"with a new zero head of {num_classes} classes" if num_classes else \
        "without its untrained head (num_classes=0)"
    note = f"{source}: pre-trained by masked patch prediction (model.mpp={mpp!r}), which trains no classifier: written"
    return with_new_head(model, num_classes or 0), f"{note} {written}"


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals in one line, as every other refusal of the command: argparse prints the
    usage block first (ten lines for `train`), and ``--help`` is where that belongs."""

    def error(self, message: str):
        report(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(2)


def report(line: str) -> None:
    """Print an error to stderr, once for a torchrun launch: every process reads the same arguments
    and met the same refusal, and each printed it.  Rank 0 prints its own; another rank prints its
    own unless it is rank 0's (``rank_0_said``), and every process exits with its code all the same."""
    launched = os.environ.get("WORLD_SIZE", "1") != "1"  # the training library is imported only then
    if launched:
        from vitlab.train.distributed import post_error, rank_0_said

        if rank_0_said(line):
            return
    print(line, file=sys.stderr, flush=True)
    if launched:
        post_error(line)


@contextlib.contextmanager
def one_line_warnings(command: str):
    """A warning shown as one line naming the command, as its refusals are: Python's own format adds
    the file, line and source of the code that warned, which tell a user nothing."""
    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *where, **_: \
        f"vitlab {command}: {category.__name__}: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = previous


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="vitlab", description="Vision Transformers, as in the paper.")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    # the version of the code that runs; pyproject.toml reads the same attribute into the package's metadata
    parser.add_argument("--version", action="version", version=f"%(prog)s {vitlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in COMMANDS:
        mod = importlib.import_module(f"vitlab.cli.{module}")
        p = sub.add_parser(name, help=help_text, description=help_text.replace("%%", "%"))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    parser.commands = sub.choices  # each command's parser, which names the command in its errors
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's own message would name "vitlab", not the command they were given to
        (parser.commands[args.command] if args.command else parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with one_line_warnings(args.command):
            return int(args._run(args) or 0)
    except KeyboardInterrupt as err:  # Ctrl-C: named as every other ending of a command is
        # the commands that can go on from where they stopped say how (checkpoints, finished runs); train's and
        # finetune's what their run's --resume goes on from
        again = "; run it again with --resume to go on from where it stopped" if hasattr(args, "resume") else ""
        again = f"; {err}" if str(err) else again
        print(f"vitlab {args.command}: interrupted{again}", file=sys.stderr)
        return 130
    # configuration and input errors (a file that is no image: PIL's UnidentifiedImageError is an
    # OSError), a checkpoint that cannot be written (OSError), a training loss that is NaN
    # (FloatingPointError): one line, no traceback
    except (ValueError, OSError, FloatingPointError) as err:
        if args.debug:
            raise
        report(f"vitlab {args.command}: error: {err}")
        return 2
    # an optional package the command needs is absent: the package and the extra that brings it
    except ImportError as err:
        from vitlab.extras import missing_package_of

        missing = missing_package_of(err)
        if missing is None or args.debug:
            raise
        report(f"vitlab {args.command}: error: {missing}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
