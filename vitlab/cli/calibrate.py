"""`vitlab calibrate`: time this CPU's dense-layer kernels once and store the choice.

    vitlab calibrate

``vitlab.fast`` picks the matrix-multiply kernels of CPU dense layers by a rule from the
CPU's vendor and flags (``vitlab.fast.kernels.rule_choice``); a stored calibration for
this CPU and torch version takes precedence.  This command measures the kernels with
this process's threads, stores the faster of each pair and prints what it chose, the
GFLOP/s of each kernel and the file written.  Nothing is ever timed inside a run.
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="timed repetitions of each kernel (the best counts)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads to time with (0: PyTorch's default)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from vitlab.fast import kernels

    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds}: must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    choice, rates = kernels.calibrate(rounds=args.rounds)
    path = kernels.calibration_path()
    if args.json:
        print(json.dumps({"choice": dataclasses.asdict(choice), "gflops": rates, "path": str(path)}))
        return 0
    print(f"chosen kernels: fp32 {choice.fp32}, bf16 {choice.bf16}")
    for name, rate in rates.items():
        print(f"  {name:<12} {rate:8.1f} GFLOP/s")
    print(f"written to {path}")
    return 0
