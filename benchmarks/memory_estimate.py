"""The memory estimate of a run (``vitlab.train.memory_estimate``) against its measured peak.

    python benchmarks/memory_estimate.py [--only NAME,...] [--data CIFAR10_TAR_GZ] [--work DIR]

Each configuration runs a few steps through the command line (``vitlab train`` or
``vitlab finetune``) in a fresh interpreter, as a user would.  Its measured peak is the
process's peak resident set (VmHWM) less that of an idle interpreter that imported the same
modules and ran one matmul (Python, PyTorch and its libraries, threads: what the estimate
leaves out, as it is in use before a run starts); its estimate is what the run wrote to its
config.json before it built anything.  Decoding workers and DataLoader workers are other
processes: the streamed configuration reads in the training process (``stream_workers=0``).

The configurations cover what the estimate counts: a plain ViT and a hybrid, fp32 and bf16
(the fast path's explicit attention), training from scratch and fine-tuning, a data set
decoded into memory and one streamed from disk, small models whose activations dominate and
a ViT-B/16 whose weights and optimiser state do.  The first run decodes CIFAR-10 into
``WORK/cache`` (a few minutes); the fine-tunes start from weights trained here first.
Prints a Markdown table: measured, estimated, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness import cpu_name, proc_status, run_worker

CIFAR = "/work/shared/data/cifar10/cifar10-train.tar.gz"
FEW = ["--steps", "4", "--quiet", "--overwrite"]
CIFAR_VIT = ["train", "--recipe", "cifar10_scratch:model=vit", "--time-limit", "0", "--set", "run.compile=false"]
CIFAR_HYBRID = ["train", "--recipe", "cifar10_scratch:model=hybrid", "--time-limit", "0", "--set", "run.compile=false"]


def cases(data: str, work: Path) -> dict[str, dict]:
    """name -> {"args": the command's arguments, "setup": arguments of a run that makes its init, "what": ...}."""
    demo, hybrid, mpp = str(work / "demo"), str(work / "hybrid"), str(work / "mpp")
    return {
        "vit-fp32-train-memory": {
            "what": "ViT-CIFAR/4 from scratch, fp32, CIFAR-10 in memory (batch 128)",
            "args": CIFAR_VIT + ["--data", data, "--precision", "fp32"]},
        "hybrid-bf16-train-memory": {
            "what": "R14+ViT-CIFAR/1 hybrid from scratch, bf16, CIFAR-10 in memory (batch 256)",
            "args": CIFAR_HYBRID + ["--data", data, "--precision", "bf16"]},
        "vit-bf16-train-streamed": {
            "what": "ViT-CIFAR/4 from scratch, bf16, CIFAR-10 streamed from its folder (batch 128)",
            "args": CIFAR_VIT + ["--data", data, "--precision", "bf16", "--stream", "stream",
                                 "--set", "data.stream_workers=0"]},
        "vits16-fp32-train-memory": {
            "what": "ViT-S/16 at 224 px from scratch, fp32, digits in memory (batch 16)",
            "args": ["train", "--recipe", "demo", "--model", "ViT-S/16", "--set", "model.overrides={}",
                     "--img-size", "224", "--batch-size", "16", "--precision", "fp32", "--data", "digits"]},
        "vit-bf16-finetune-memory": {
            "what": "the demo's ViT-demo/4 fine-tuned at 96 px (577 tokens), bf16, digits (batch 32)",
            "setup": ["demo", "--out", demo, "--steps", "50", "--no-report", "--quiet"],
            "args": ["finetune", "--init", demo, "--data", "digits", "--img-size", "96", "--batch-size", "32"]},
        "hybrid-fp32-finetune-memory": {
            "what": "the hybrid fine-tuned at its default size (56 px), fp32, CIFAR-10 in memory (batch 64)",
            "setup": CIFAR_HYBRID + ["--data", data, "--steps", "2", "--out", hybrid, "--quiet", "--overwrite"],
            "args": ["finetune", "--init", hybrid, "--data", data, "--batch-size", "64", "--precision", "fp32"]},
        "vitb16-bf16-finetune-memory": {
            "what": "ViT-B/16 after masked patch prediction at 32 px, fine-tuned at its default size (48 px), bf16, "
                    "CIFAR-10 in memory (batch 64)",
            "setup": ["train", "--recipe", "mpp", "--data", data, "--img-size", "32", "--batch-size", "64",
                      "--steps", "2", "--out", mpp, "--quiet", "--overwrite"],
            "args": ["finetune", "--init", mpp, "--data", data, "--batch-size", "64"]},
    }


def child(args: list[str]) -> None:
    """Run one command in this process; print its peak resident set and its estimate."""
    import contextlib
    import io

    from vitlab.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    out = Path(args[args.index("--out") + 1])
    estimate = json.loads((out / "config.json").read_text())["memory_estimate"]
    print("RESULT " + json.dumps({"rc": rc, "peak": proc_status("VmHWM"), "estimate": estimate}))


def baseline(digits: bool) -> None:
    """An idle interpreter that imported what a run imports (with the digits, scikit-learn's
    loader: 0.14 GB), and ran one matmul (its threads)."""
    import torch

    import vitlab.cli.train  # noqa: F401
    import vitlab.data.memory  # noqa: F401
    import vitlab.train.loop  # noqa: F401

    if digits:
        import sklearn.datasets  # noqa: F401

    torch.ones(256, 256) @ torch.ones(256, 256)
    print("RESULT " + json.dumps({"peak": proc_status("VmHWM")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--data", default=CIFAR, help="CIFAR-10 training set (.tar.gz of an ImageFolder)")
    parser.add_argument("--work", default="/tmp/vitlab-memory-estimate", help="runs, inits and the data cache")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", choices=("plain", "digits"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.baseline:
        return baseline(args.baseline == "digits")

    import datetime
    import os

    work = Path(args.work)
    os.environ["VITLAB_CACHE"] = str(work / "cache")  # the children's decoded data, kept between runs
    script = str(Path(__file__).resolve())
    chosen = cases(args.data, work)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    idle = {kind: run_worker([sys.executable, script, "--baseline", kind])["peak"] for kind in ("plain", "digits")}
    print(f"{cpu_name()}, {datetime.date.today()}; idle interpreter {idle['plain'] / 1e9:.2f} GB, with scikit-learn's "
          f"digits loader {idle['digits'] / 1e9:.2f} GB (subtracted)\n")
    print("| configuration | measured peak (GB) | estimate (GB) | estimate / measured | estimate's moment |")
    print("|---|---|---|---|---|")
    for name, case in chosen.items():
        if "setup" in case:
            setup = subprocess.run([sys.executable, "-m", "vitlab", *case["setup"]], capture_output=True, text=True)
            if setup.returncode:
                print(f"| {name} | setup failed: {setup.stderr.strip().splitlines()[-1:]} | | | |")
                continue
        command = case["args"] + FEW + ["--out", str(work / name)]
        result = run_worker([sys.executable, script, "--child", json.dumps(command)], timeout=3600)
        if "error" in result:
            print(f"| {name} | failed: {result['error']} | | | |")
            continue
        kind = "digits" if "digits" in case["args"] else "plain"
        measured, estimate = (result["peak"] - idle[kind]) / 1e9, result["estimate"]["peak_gb"]
        print(f"| {name}: {case['what']} | {measured:.3f} | {estimate:.3f} | {estimate / measured:.2f} | "
              f"{result['estimate']['at']} |", flush=True)


if __name__ == "__main__":
    main()
