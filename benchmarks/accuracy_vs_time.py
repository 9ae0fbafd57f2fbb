"""Validation accuracy against wall-clock time for a training recipe (issue 3's CIFAR goal).

    python benchmarks/accuracy_vs_time.py --minutes 30                      # train, then print
    python benchmarks/accuracy_vs_time.py --run-dir runs/c10 --no-train     # print an existing run

Trains ``--recipe`` (default cifar10_scratch on ../shared/data/cifar10) under a time limit,
evaluating on the held-out split every ``--eval-every`` steps, then prints one row per
evaluation: elapsed minutes, epoch, validation top-1 by the recipe's protocol (and, where
logged, the mirror pair's and the single view's) — and the first time each accuracy
threshold was reached.  The evaluations themselves are inside the time budget.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cifar10" / "cifar10-train.tar.gz"


def read_evaluations(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a half-written last line of a killed run
            continue
        if "val_top1" in record:
            rows.append(record)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="cifar10_scratch")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--run-dir", default="runs/accuracy_vs_time")
    p.add_argument("--no-train", action="store_true", help="only print the evaluations of --run-dir")
    p.add_argument("--thresholds", type=float, nargs="*", default=[0.5, 0.6, 0.7, 0.8, 0.9, 0.94])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    if not args.no_train:
        cmd = [sys.executable, "-m", "vitlab", "train", "--recipe", args.recipe, "--data", args.data,
               "--time-limit", str(args.minutes), "--out", str(run_dir), "--quiet", "--overwrite",
               "--set", f"eval_every={args.eval_every}"]
        for item in args.overrides:
            cmd += ["--set", item]
        subprocess.run(cmd, check=True)
    rows = read_evaluations(run_dir)
    if not rows:
        print(f"no evaluations in {run_dir / 'metrics.jsonl'}", file=sys.stderr)
        return 1
    # the recipe's protocol, then the cheaper views it also logged (the final evaluation may add views)
    views = [k for k in ("val_top1_flip", "val_top1_single") if any(k in r for r in rows)]
    heads = {"val_top1_flip": "flip pair", "val_top1_single": "single"}
    print(f"{'minutes':>8} {'epoch':>6} {'step':>6} {'val top-1':>10}" + "".join(f" {heads[k]:>10}" for k in views))
    for r in rows:
        extra = "".join(f" {r[k]:10.2%}" if k in r else f" {'':>10}" for k in views)
        print(f"{r['elapsed_s'] / 60:8.1f} {r.get('epoch', float('nan')):6.2f} {r['step']:6d} {r['val_top1']:10.2%}{extra}")
    for t in args.thresholds:
        first = next((r for r in rows if r["val_top1"] >= t), None)
        when = f"{first['elapsed_s'] / 60:.1f} min (step {first['step']})" if first else "not reached"
        print(f"time to {t:.0%}: {when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
