"""`vitlab models`: the registry as a table."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--filter", default="", help="only names containing this text")


def run(args: argparse.Namespace) -> int:
    from vitlab.models.registry import count_parameters, get_config, list_models

    try:
        from vitlab.analysis.cost import model_flops
    except ImportError:  # the cost module is optional for this listing
        model_flops = None
    rows = []
    for name in list_models():
        if args.filter and args.filter.lower() not in name.lower():
            continue
        cfg = get_config(name)
        gflops = f"{model_flops(cfg) / 1e9:.1f}" if model_flops else "-"
        h, w = cfg.img_size  # a non-square registration's width too: its height alone named a square size
        rows.append((name, f"{count_parameters(cfg):,}", f"{h}" if h == w else f"{h}x{w}", gflops))
    if not rows:
        raise ValueError(f"--filter {args.filter!r}: no registered model's name contains it; `vitlab models` lists "
                         f"all {len(list_models())}")
    header = ("model", "parameters", "resolution", "GFLOPs")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for r in (header, *rows):
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    return 0
