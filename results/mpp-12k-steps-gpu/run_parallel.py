"""How results.json beside this file was made: the runs of `vitlab experiment mpp --seeds 2
--set 'budgets=[0]' --set steps=12000 --set targets=color` (vitlab/experiments/mpp.py: run calls
mpp_then_finetune and scratch for each seed), one process per (seed, arm), so that the four runs
shared the one lent GPU within the session's device time.  A record, not a tool:

    PYTHONPATH=. python3 run_parallel.py OUT 12000 0,1 path/to/cifar10-train.tar.gz
"""
import json, sys, time, multiprocessing as mp
from pathlib import Path

OUT = Path(sys.argv[1]); STEPS = int(sys.argv[2]); SEEDS = [int(x) for x in sys.argv[3].split(",")]
DATA = sys.argv[4] if len(sys.argv) > 4 else ".gpujob/cifar10-train.tar.gz"

def settings():
    from vitlab.experiments import settings as make
    return make("mpp", False, data=DATA, steps=STEPS, budgets=(0,), targets="color",
                seeds=max(SEEDS) + 1, threads=3)

def job(arm, seed):
    from vitlab.experiments import mpp
    s = settings(); runs = Path("/tmp/mpp-runs"); t0 = time.time()
    row = mpp.mpp_then_finetune(s, runs, 0, seed, "color") if arm == "mpp" else mpp.scratch(s, runs, 0, seed)
    row["process_s"] = round(time.time() - t0, 1)
    with open(OUT / f"row-{arm}-s{seed}.json", "w") as f:
        json.dump(row, f)
    print(row, flush=True)

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    json.dump(settings().as_dict(), open(OUT / "settings.json", "w"), default=str)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=job, args=(arm, seed)) for seed in SEEDS for arm in ("mpp", "scratch")]
    for p in procs: p.start()
    for p in procs: p.join()
