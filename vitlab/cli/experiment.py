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
    p.add_argument("--steps", type=int, help="optimiser steps per run (a ceiling with --time-limit)")
    p.add_argument("--time-limit", "--minutes", dest="time_limit", type=float, metavar="MINUTES",
                   help="wall-time limit per run, in minutes")
    p.add_argument("--device", help="auto, cpu, cuda, ...")
    p.add_argument("--threads", type=int, help="CPU threads (0: PyTorch's default, at most the usable cores)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting of the experiment, e.g. --set sizes=[2000,5000] --set batch_size=256")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs an earlier invocation into the same --out finished with the same config "
                   "(an interrupted experiment, or more --seeds, trains only what is missing)")
    p.add_argument("--findings", metavar="PATH", help="also put the section into this markdown file "
                   "(between <!-- experiment:NAME --> markers), e.g. docs/findings.md")


def run(args: argparse.Namespace) -> int:
    from vitlab import experiments
    from vitlab.config import need_output_file, need_output_folder

    if args.list or not args.name:
        for name, title, paper in experiments.describe(args.name if args.list else None):  # --list NAME: that one
            print(f"{name:<20} {title}\n{'':<20} paper: {paper}")
        return 0 if args.list else 2
    changes = dict(seeds=args.seeds, data=args.data, steps=args.steps, time_limit=args.time_limit,
                   device=args.device, threads=args.threads, resume=args.resume or None)
    changes.update(parse_settings(args.name, args.quick, args.set))
    out = args.out or f"results/{args.name}" + ("-quick" if args.quick else "")
    need_output_folder("--out", out)  # as typed: run_experiment's own check names its argument, out=
    if args.findings:  # refused after the runs, it cost them all
        need_output_file("--findings", args.findings)
        findings_block(args.findings, args.name)
    result = experiments.run_experiment(args.name, out, quick=args.quick,
                                        command=command_of(args), **changes)
    if args.findings:
        update_findings(args.findings, args.name, result["files"]["section"].read_text(), out)
    return 0


def parse_settings(name: str, quick: bool, assignments: list[str]) -> dict:
    """``KEY=VALUE`` strings as experiment ``name``'s settings, each value read as the train
    config reads ``--set`` (``vitlab.train.overrides.parse_value``): a value of the type of the
    setting's default.  A former name (``batch``, ``heads``...) is mapped to today's; an unknown
    one is refused."""
    from vitlab import experiments
    from vitlab.train.overrides import parse_value

    form, other = experiments.defaults(name, quick), experiments.defaults(name, not quick)
    changes = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        key = experiments.setting_name(name, key.strip())
        default = form[key] if key in form else other.get(key)
        try:
            changes[key] = parse_value(text, default)
        except ValueError as err:
            raise ValueError(f"--set {key}={text!r}: {err}") from None
    return changes


def command_of(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (from the parsed options, not sys.argv)."""
    import shlex

    parts = ["vitlab", "experiment", args.name] + (["--quick"] if args.quick else [])
    for opt in ("seeds", "data", "steps", "time_limit", "device", "threads", "out"):
        value = getattr(args, opt)
        if value is not None:
            parts += [f"--{opt.replace('_', '-')}", str(value)]
    for item in args.set:
        parts += ["--set", item]
    return " ".join(shlex.quote(p) for p in parts)


# In a findings block, what follows this line is the author's reading of the result: a
# re-run replaces the generated section above it and keeps the reading.
READING = "<!-- reading -->"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- experiment:{name} -->", f"<!-- /experiment:{name} -->"


def findings_block(path: str, name: str) -> tuple[int, int] | None:
    """Where experiment ``name``'s block lies in the file at ``path`` (from its begin marker to past
    its end marker), None where the file or the block is absent.  Markers that do not make one block
    are refused: with a begin marker alone the section was appended with a pair of its own, and the
    next run replaced everything from the lone marker to that pair's end, the hand-written text
    between them included; a second block was left as it was, stale."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        return None
    text = p.read_text()
    begin, end = markers(name)
    counts = text.count(begin), text.count(end)
    if counts == (0, 0):
        return None
    if counts != (1, 1) or text.index(end) < text.index(begin):
        raise ValueError(f"--findings {path}: {begin} appears {counts[0]} time(s) and {end} {counts[1]} time(s); "
                         "expected one of each, in that order (or neither: the section is appended): fix the markers")
    return text.index(begin), text.index(end) + len(end)


def update_findings(path: str, name: str, section: str, out: str) -> None:
    """Replace (or append) the block between ``<!-- experiment:NAME -->`` markers, keeping the
    block's hand-written reading (what follows ``READING``) below the new section.  The file is
    replaced whole (``atomic_write``: a temporary file renamed over it, its mode kept): a write that
    fails or is interrupted leaves it as it was, not cut short."""
    import os
    from pathlib import Path

    from vitlab.files import atomic_write

    p = Path(path)
    rel = os.path.relpath(out, p.parent)
    section = section.replace("](figure.png)", f"]({rel}/figure.png)")
    begin, end = markers(name)
    text = p.read_text() if p.exists() else "# Findings\n"
    block = findings_block(path, name)
    if block is not None:
        old = text[block[0]:block[1]]
        reading = old[old.index(READING):-len(end)].rstrip() + "\n\n" if READING in old else ""
        text = text[:block[0]] + f"{begin}\n{section}\n{reading}{end}" + text[block[1]:]
    else:
        text = text.rstrip() + "\n\n" + f"{begin}\n{section}\n{end}" + "\n"
    try:
        atomic_write(p, lambda f: f.write(text.encode()))
    except OSError as err:
        raise OSError(f"--findings {path}: could not be written ({err.strerror or err}); the section is in "
                      f"{Path(out) / 'section.md'}") from err
