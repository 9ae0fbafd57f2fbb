"""`vitlab experiment`: the paper's experiments in miniature (vitlab/experiments/)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="the experiment (see --list)")
    p.add_argument("--list", action="store_true", help="list the experiments and the paper figure each mirrors")
    p.add_argument("--quick", action="store_true", help="the same code at a smoke-test size (digits, seconds)")
    p.add_argument("--out", help="output folder (default results/NAME, results/NAME-quick with --quick)")
    p.add_argument("--seeds", type=int, help="runs per setting (default 1 with --quick, else the experiment's: 2 or 3)")
    p.add_argument("--data", help="data: an ImageFolder archive such as cifar10-train.tar.gz, or 'digits'")
    p.add_argument("--steps", type=int, help="optimiser steps per run (a ceiling with --minutes)")
    p.add_argument("--minutes", type=float, help="wall-time limit per run")
    p.add_argument("--device", help="auto, cpu, cuda, ...")
    p.add_argument("--threads", type=int, help="CPU threads (0: PyTorch's default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting of the experiment, e.g. --set sizes=[2000,5000] --set batch=256")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs an earlier invocation into the same --out finished with the same config "
                   "(an interrupted experiment, or more --seeds, trains only what is missing)")
    p.add_argument("--findings", metavar="PATH", help="also put the section into this markdown file "
                   "(between <!-- experiment:NAME --> markers), e.g. docs/findings.md")


def run(args: argparse.Namespace) -> int:
    from vitlab import experiments
    from vitlab.experiments.common import parse_value

    if args.list or not args.name:
        for name, title, paper in experiments.describe():
            print(f"{name:<20} {title}\n{'':<20} paper: {paper}")
        return 0 if args.list else 2
    changes = dict(seeds=args.seeds, data=args.data, steps=args.steps, minutes=args.minutes, device=args.device,
                   threads=args.threads, resume=args.resume or None)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        changes[key.strip()] = parse_value(value)
    out = args.out or f"results/{args.name}" + ("-quick" if args.quick else "")
    result = experiments.run_experiment(args.name, out, quick=args.quick,
                                        command=command_of(args), **changes)
    if args.findings:
        update_findings(args.findings, args.name, result["files"]["section"].read_text(), out)
    return 0


def command_of(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (from the parsed options, not sys.argv)."""
    import shlex

    parts = ["vitlab", "experiment", args.name] + (["--quick"] if args.quick else [])
    for opt in ("seeds", "data", "steps", "minutes", "device", "threads", "out"):
        value = getattr(args, opt)
        if value is not None:
            parts += [f"--{opt}", str(value)]
    for item in args.set:
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts)


# In a findings block, what follows this line is the author's reading of the result: a
# re-run replaces the generated section above it and keeps the reading.
READING = "<!-- reading -->"


def update_findings(path: str, name: str, section: str, out: str) -> None:
    """Replace (or append) the block between ``<!-- experiment:NAME -->`` markers, keeping the
    block's hand-written reading (what follows ``READING``) below the new section."""
    import os
    from pathlib import Path

    p = Path(path)
    rel = os.path.relpath(out, p.parent)
    section = section.replace("](figure.png)", f"]({rel}/figure.png)")
    begin, end = f"<!-- experiment:{name} -->", f"<!-- /experiment:{name} -->"
    text = p.read_text() if p.exists() else "# Findings\n"
    if begin in text and end in text:
        old = text[text.index(begin):text.index(end)]
        reading = old[old.index(READING):].rstrip() + "\n\n" if READING in old else ""
        text = text[:text.index(begin)] + f"{begin}\n{section}\n{reading}{end}" + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + f"{begin}\n{section}\n{end}" + "\n"
    p.write_text(text)
