"""How results.json beside this file was made: the runs of `vitlab experiment mpp --seeds 2
--set 'budgets=[0]' --set steps=12000 --set targets=color` (vitlab/experiments/mpp.py: run, the
same configs through the same train_vit), one process per (seed, arm), so that the four runs
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
    from vitlab.experiments.common import train_vit, vit_overrides
    s = settings(); share = float(s.get("pretrain_share", 0.6)); pre_steps = max(1, int(s.steps * share))
    init = {"model.patch_init": s.get("patch_init", "lecun")}
    runs = Path("/tmp/mpp-runs"); t0 = time.time()
    if arm == "mpp":
        pre = train_vit(s, runs / f"0min-mpp-color-s{seed}", seed, vit_overrides(s), dict(
            init, **{"model.mpp": "color", "model.mpp_rate": 0.5, "optim.steps": pre_steps, "run.time_limit": 0.0}))
        print("pretrain done", seed, pre["steps"], pre["wall_s"], flush=True)
        ft = train_vit(s, runs / f"0min-finetune-color-s{seed}", seed, vit_overrides(s), {
            "model.init": pre["weights"], "model.overrides": {}, "optim.steps": s.steps - pre_steps,
            "run.time_limit": 0.0})
        row = dict(budget_min=0, run="mpp:color+finetune", seed=seed, val_top1=ft["val_top1"],
                   wall_s=pre["wall_s"] + ft["wall_s"], steps=pre["steps"] + ft["steps"])
    else:
        sc = train_vit(s, runs / f"0min-scratch-s{seed}", seed, vit_overrides(s), dict(init, **{"run.time_limit": 0.0}))
        row = dict(budget_min=0, run="scratch", seed=seed, val_top1=sc["val_top1"], wall_s=sc["wall_s"], steps=sc["steps"])
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
