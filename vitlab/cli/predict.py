"""`vitlab predict`: the top-5 classes of images, with probabilities.

    vitlab predict --checkpoint runs/demo/model.safetensors cat.png dog.jpg
    vitlab predict --checkpoint google/vit-base-patch16-224 cat.png     # the Hugging Face cache

Class names come from the weights file itself (a vitlab file's metadata, a timm export's
``label_names``), else ``classes.json`` beside the weights (written by `train`), else the
``id2label`` of a Hugging Face ``config.json``; without any the classes are printed as numbers.  Images are resized to the model's resolution
(``--img-size``: another, its position embeddings resampled) and scaled to [-1, 1] as in training.

The probabilities are those the run was trained to give (``vitlab.eval.features.class_probabilities``,
as the evaluator scores them): a run folder's ``config.json`` (beside the weights) records its
``optim.loss``, and a ``sigmoid_xent`` run's are each class's own sigmoid, which need not sum to 1
(said in the output: a header, and ``sigmoid_prob`` in place of ``prob`` in JSON); weights converted
from such a run record it themselves (``vitlab.weights.read_loss``: a vitlab file's metadata, a Hugging
Face ``problem_type``, of a Hub model too); weights that record none get the softmax.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from vitlab.cli import add_img_size_argument, add_weights_arguments, load_weights

from .eval import trained_run_meta
from .train import add_fast_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="weights: a .safetensors file or run folder written by train, any format `vitlab` reads, "
                        "or a Hugging Face Hub name (org/name: the local cache, else downloaded)")
    p.add_argument("--classes", help="JSON list of class names (default: classes.json beside the weights)")
    p.add_argument("--top", type=int, default=5, help="how many classes to show")
    p.add_argument("--json", action="store_true", help="one JSON line per image")
    add_img_size_argument(p, "input resolution; position embeddings are resampled")
    add_weights_arguments(p)
    p.add_argument("images", nargs="+", help="image files")
    add_fast_argument(p)


def find_classes(checkpoint: Path, explicit: str | None, num_classes: int) -> list[str] | None:
    """``--classes``, else the names kept with the weights (``vitlab.weights.read_class_names``:
    the file's own, ``classes.json`` beside it, a Hugging Face config's ``id2label``); either
    one name per output of the model (a shorter list failed on the first image with an IndexError)."""
    from vitlab.weights import read_class_names
    from vitlab.weights.labels import check_class_names, names_from_json

    if explicit:
        if Path(explicit).is_dir():
            raise IsADirectoryError(f"--classes {explicit}: a folder; expected a JSON file of class names")
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"--classes {explicit}: no such file")
        names = names_from_json(Path(explicit).read_text(errors="replace"), f"--classes {explicit}")
        return check_class_names(names, num_classes, f"--classes {explicit}")
    names = read_class_names(checkpoint)
    return None if names is None else check_class_names(names, num_classes, f"the class names kept with {checkpoint}")


def check_image_files(paths: list[str]) -> None:
    """Every image named is a file, checked before the model is loaded: a mistyped name among many
    stopped the command there, after the images before it had been scored."""
    for path in paths:
        if not Path(path).is_file():
            what = "a folder; expected image files" if Path(path).is_dir() else "no such file"
            raise FileNotFoundError(f"{path}: {what}")


def run(args: argparse.Namespace) -> int:
    import torch

    from vitlab import fast
    from vitlab.analysis.report import recorded_loss
    from vitlab.data.memory import decode_image
    from vitlab.data.transforms import to_float
    from vitlab.eval.features import class_probabilities
    from vitlab.train.resolve import resolve_scoring, resolved_threads
    from vitlab.weights.hub import resolve_hub_name

    if args.top < 1:
        raise ValueError(f"--top {args.top}: must be a positive integer (how many classes to show)")
    check_image_files(args.images)
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():  # a Hub name: its snapshot folder, which holds config.json
        checkpoint = resolve_hub_name(args.checkpoint) or checkpoint
    # a run that trained no classifier is refused before its model is read; its loss: what the probabilities are
    loss = recorded_loss(trained_run_meta(checkpoint))
    model = load_weights(args, checkpoint).eval()
    if not model.cfg.num_classes:  # its features were shown as the probabilities of as many classes
        raise ValueError(f"{args.checkpoint}: the model has no head (num_classes=0): it gives features, not class "
                         "scores; fine-tune it (vitlab finetune) for a classifier")
    resolved = resolve_scoring("cpu", fast_path=args.fast is not False)  # on this CPU, as a run resolves it
    if resolved.kernels is not None:
        fast.optimize(model, resolved.kernels)
    classes = find_classes(checkpoint, args.classes, model.cfg.num_classes)
    size = model.cfg.img_size
    # every image decoded before the first result is printed: a file that is no image stopped the
    # command there, after the results before it (held at the model's size: 150 KB an image at 224)
    arrays = [decode_image(path, size) for path in args.images]  # (H, W, 3) uint8
    with torch.no_grad(), resolved_threads(resolved):
        for path, array in zip(args.images, arrays):
            x = to_float(torch.from_numpy(array.copy()).permute(2, 0, 1).unsqueeze(0).contiguous())
            print_top(args, path, class_probabilities(model(x).float(), loss=loss)[0], classes, loss)
    return 0


def print_top(args: argparse.Namespace, path: str, probs, classes: list[str] | None,
              loss: str = "softmax_xent") -> None:
    """The ``--top`` classes of one image's probabilities (K,), best first, equal ones the lower class
    first (as eval counts them; topk's order among equals is its own): a JSON line or a few to read.
    A sigmoid_xent run's, each class's own, are named so (``sigmoid_prob``; a header): they need not
    sum to 1, and a softmax's reader would take them for shares of one."""
    top = probs.sort(descending=True, stable=True)
    names = [classes[i] if classes else str(i) for i in top.indices[:args.top].tolist()]
    values = top.values[:args.top].tolist()
    key = "sigmoid_prob" if loss == "sigmoid_xent" else "prob"
    if args.json:
        print(json.dumps({"image": path, "top": [{"class": n, key: round(p, 6)} for n, p in zip(names, values)]}))
        return
    print(path + ("  (sigmoid probabilities, each class its own: they need not sum to 1)"
                  if loss == "sigmoid_xent" else ""))
    for name, prob in zip(names, values):
        print(f"  {prob:7.2%}  {name}")
