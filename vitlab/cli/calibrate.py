"""`vitlab calibrate`: time whole steps of the plain and fast models once and store what wins.

    vitlab calibrate

``vitlab.fast`` picks the kernels of a fast model's CPU blocks by a rule per CPU class
(``vitlab.fast.kernels.rule_for``); a stored calibration for this CPU and torch version
takes precedence.  This command times training and inference steps of the plain model and
of every kernel choice this machine can run (``vitlab.fast.calibration``), stores the
winners, which modes stay plain, and what ``--precision auto`` means, and prints them with
the step times and the file written.  Nothing is ever timed inside a run.
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of every step (the median counts)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads to time with (0: PyTorch's default, at most the usable cores)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from vitlab.fast import calibration, kernels
    from vitlab.machine import usable_cores
    from vitlab.train.resolve import thread_count

    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds}: must be >= 1")
    asked = thread_count(args.threads, usable_cores(), "--threads")  # timed with the threads a run takes
    threads = torch.get_num_threads()
    torch.set_num_threads(asked)
    try:
        choice, precision, seconds = calibration.calibrate(rounds=args.rounds,
                                                           say=(lambda line: None) if args.json else print)
    finally:
        torch.set_num_threads(threads)
    path = kernels.calibration_path()
    if args.json:
        print(json.dumps({"kernels": dataclasses.asdict(choice), "precision": precision,
                          "seconds_per_step": seconds, "path": str(path)}))
        return 0
    print(f"chosen: {choice.describe()}; --precision auto means {precision}")
    print(f"written to {path}")
    return 0
