"""`vitlab inspect`: one self-contained HTML report on a checkpoint (paper Fig. 6, 7, 10, 11, 14).

    vitlab inspect runs/b16/model.safetensors --images cat.jpg dog.jpg --out report.html
"""
from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.cli import add_img_size_argument, add_weights_arguments, load_weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="weights: vitlab .safetensors/dir, official .npz, timm, HF")
    p.add_argument("--images", nargs="+", required=True, help="image files to analyse (a few)")
    p.add_argument("--run-dir", default=None,
                   help="training run folder with metrics.jsonl (default: the checkpoint's folder, if it has one)")
    p.add_argument("--out", default="report.html", help="the HTML file to write")
    add_img_size_argument(p, "input resolution; position embeddings are resampled")
    add_weights_arguments(p)


def check_run_dir(run_dir: str | None) -> None:
    """A --run-dir given holds a training log: a mistyped one gave a report without curves and exit 0
    (the library notes a missing log in the page; here the folder was named on purpose)."""
    if run_dir is None:
        return
    if not Path(run_dir).is_dir():
        what = "a file" if Path(run_dir).exists() else "no such folder"
        raise ValueError(f"--run-dir {run_dir}: {what}; expected a training run's folder (with metrics.jsonl)")
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        raise ValueError(f"--run-dir {run_dir}: holds no metrics.jsonl; expected a training run's folder "
                         "(`vitlab train --out`)")


def run(args: argparse.Namespace) -> int:
    from vitlab.analysis.report import need_report_out, read_run_meta, write_report
    from vitlab.cli.predict import check_image_files, find_classes
    from vitlab.config import need_output_file
    from vitlab.extras import require

    require("matplotlib", "the inspection report")  # before the model is loaded and analysed
    check_run_dir(args.run_dir)
    need_output_file("--out", args.out)
    need_report_out(args.out, "--out")  # not over the images or weights named by mistake
    check_image_files(args.images)  # a mistyped name stopped the report after the model had loaded

    model = load_weights(args, args.checkpoint).eval()
    meta = read_run_meta(args.checkpoint)
    # predict's names (the weights' own, classes.json, an id2label), one per output of the model: another
    # model's labelled these outputs; a model without a head names none
    names = find_classes(Path(args.checkpoint), None, model.cfg.num_classes) if model.cfg.num_classes else None
    if names is not None:
        meta["classes"] = names
    meta.setdefault("checkpoint", args.checkpoint)
    out = write_report(model, args.images, args.out, run_dir=args.run_dir, meta=meta)
    print(f"wrote {out}")
    return 0
