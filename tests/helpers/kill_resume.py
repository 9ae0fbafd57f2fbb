"""Kill `vitlab train` with SIGKILL at random moments, resume it each time, and check that
the final weights are bit-equal (torch.equal, every tensor) to an uninterrupted run's.

    python tests/helpers/kill_resume.py --kills 10                # 10 random kills, 2 aimed at a write
    python tests/helpers/kill_resume.py --kills 10 --write-kills 3 --seed 1
    python tests/helpers/kill_resume.py --torchrun                # 2 processes, one killed, torchrun restarts
    python tests/helpers/kill_resume.py --torchrun --fsdp         # the same, the model sharded with FSDP

The run: a ViT of 4 blocks (width 32, 4x4 patches) on a synthetic ImageFolder of 5
classes x 16 images of 16x16 pixels, batch 16, Adam, dropout 0.1, random crops and flips
(every kind of state a resume must restore), 200 steps (``--steps``) with a checkpoint
every 5, keeping 2; one
thread (OMP_NUM_THREADS=1, run.threads=1) so that the arithmetic is deterministic.

A random kill waits for the launch to start training (its ``config.json`` rewritten),
then a seeded random moment of the training time left (the uninterrupted run's, from
its first step to its last checkpoint, times the share of steps after the checkpoint
resumed from): uniform in [0, 2/k) of it with k kills still to make, at most 90 %, so
that the kills spread over the whole run; and sends SIGKILL.
It "landed in a write" when a checkpoint's temporary file is left behind.  A kill aimed
at a write launches the run through ``held_checkpoint_writes.py`` (every write held open
``HOLD_S`` before its rename) and fires as soon as a temporary file appears.  After every kill the run is
launched again with ``--resume``; the last launch runs to the end.

``--torchrun``: the same run under ``torchrun --nproc_per_node 2 --max-restarts 1``
(gloo); rank 1 is killed during the second checkpoint write, torchrun restarts the
group, which resumes by itself, and the result is compared with an uninterrupted
2-process run.  tests/train/test_crash.py runs both on a small budget.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HELD_WRITES = Path(__file__).resolve().with_name("held_checkpoint_writes.py")
MODEL = {"img_size": 16, "patch_size": 4, "width": 32, "depth": 4, "num_heads": 4, "mlp_dim": 64, "dropout": 0.1}
TIMEOUT_S = 300
# seconds a write is held open: the time a kill aimed at it has to land once its temporary file is
# seen, which on a busy machine includes a wait for a CPU (this process's, between seeing the file
# and the kill).  The kill ends the hold: it costs nothing but for the held writes before it (the
# torchrun run's first checkpoint)
HOLD_S = 5.0


def make_data(root: Path, classes: int = 5, per_class: int = 16) -> Path:
    """A tiny ImageFolder: each class a dominant colour plus noise (PNG, 16x16)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 100, (16, 16, 3), dtype=np.uint8)
            pixels[:, :, c % 3] += 120 + 20 * (c // 3)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def train_args(data: Path, out: Path, cache: Path, steps: int, ckpt_every: int = 5) -> list[str]:
    """`vitlab train` arguments of the run described above."""
    sets = {f"model.{k}": v for k, v in MODEL.items()} | {
        "data.decode_workers": 0, "data.cache_dir": cache, "run.threads": 1, "run.tensorboard": "false",
        "run.ckpt_every": ckpt_every, "run.keep_ckpts": 2, "run.log_every": 5, "optim.warmup": 3,
        "augment.crop": "pad", "augment.crop_pad": 2, "augment.flip": "true"}
    args = ["train", "--recipe", "demo", "--data", str(data), "--val-split", "0", "--steps", str(steps),
            "--batch-size", "16", "--out", str(out), "--quiet"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def environment() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(args: list[str], env: dict, torchrun: int = 0, max_restarts: int = 0,
           hold_writes: float = 0.0) -> subprocess.Popen:
    """`vitlab ARGS` in a new process (``torchrun`` of them); with ``hold_writes``, every
    checkpoint write held open that many seconds (``held_checkpoint_writes.py``)."""
    program = [str(HELD_WRITES), str(hold_writes)] if hold_writes else ["-m", "vitlab"]
    launcher = [sys.executable, *program]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                    f"--max-restarts={max_restarts}", *program]
    return subprocess.Popen(launcher + args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, out, err


def partial_writes(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp")) if folder.is_dir() else []


def checkpoints(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return sorted(n for n in os.listdir(folder) if n.startswith("ckpt-")) if folder.is_dir() else []


def wait_for(condition, proc: subprocess.Popen, poll_s: float = 0.002) -> bool:
    """Poll ``condition`` until it holds (True) or ``proc`` exits (False)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return bool(condition())
        time.sleep(poll_s)
    raise TimeoutError("the training process neither reached the moment nor ended")


def training_started(out: Path, since: float):
    """A condition: this launch rewrote ``config.json`` (it built everything and starts its steps)."""
    path = out / "config.json"
    return lambda: path.exists() and path.stat().st_mtime >= since


def reference_run(data: Path, out: Path, cache: Path, steps: int) -> tuple[dict, float]:
    """The uninterrupted run: (its summary, seconds from its first step to its last checkpoint)."""
    since = time.time()
    proc = launch(train_args(data, out, cache, steps), environment())
    wait_for(training_started(out, since), proc)
    t_train = time.monotonic()
    wait_for(lambda: (out / "checkpoints" / f"ckpt-{steps:08d}.pt").exists(), proc)
    train_s = time.monotonic() - t_train
    code, stdout, stderr = finish(proc)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{stderr[-3000:]}")
    return last_json(stdout), train_s


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def kill(proc: subprocess.Popen) -> bool:
    """SIGKILL ``proc``; False when it had already ended."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=TIMEOUT_S)
    return True


def weights_equal(a_path: str, b_path: str) -> tuple[bool, int]:
    """(every tensor bit-equal, number of tensors)."""
    import torch

    from vitlab.weights import load_model

    a, b = load_model(a_path).state_dict(), load_model(b_path).state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), len(a)


def kill_and_resume(workdir: Path, kills: int, write_kills: int, seed: int, steps: int) -> dict:
    """The experiment: a reference run, then a run killed ``kills`` times (the first
    ``write_kills`` aimed at checkpoint writes) and resumed after each; the report."""
    rng = random.Random(seed)
    data, cache = make_data(workdir / "images"), workdir / "cache"
    reference, train_s = reference_run(data, workdir / "reference", cache, steps)
    out = workdir / "killed"
    plan = ["write"] * write_kills + ["random"] * (kills - write_kills)
    rng.shuffle(plan)
    events, resume = [], False
    for number, kind in enumerate(plan):
        done = int(checkpoints(out)[-1][5:13]) if checkpoints(out) else 0  # the step the next launch resumes at
        if done >= steps:  # an earlier kill came after the last step: nothing left to interrupt
            break
        args = train_args(data, out, cache, steps) + (["--resume"] if resume else [])
        since = time.time()
        if kind == "write":
            proc = launch(args, environment(), hold_writes=HOLD_S)
            reached = wait_for(lambda: bool(partial_writes(out)), proc)
        else:
            proc = launch(args, environment())
            reached = wait_for(training_started(out, since), proc)
            if reached:  # a random moment of what is left, spread so that the kills cover the whole run
                left_s, kills_left = train_s * (steps - done) / steps, len(plan) - number
                time.sleep(min(rng.uniform(0.0, 2.0) / kills_left, 0.9) * left_s)
        killed = reached and kill(proc)
        if not killed:  # the run ended before the moment came
            code, _, stderr = finish(proc)
            events.append({"kind": kind, "killed": False, "resumed_at": done, "exit": code})
            if code != 0:
                raise RuntimeError(f"a launch failed:\n{stderr[-3000:]}")
            break
        events.append({"kind": kind, "killed": True, "resumed_at": done, "in_write": bool(partial_writes(out)),
                       "checkpoints_left": checkpoints(out)})
        resume = True
    proc = launch(train_args(data, out, cache, steps) + (["--resume"] if resume else []), environment())
    code, stdout, stderr = finish(proc)
    if code != 0:
        raise RuntimeError(f"the final resume failed:\n{stderr[-3000:]}")
    summary = last_json(stdout)
    equal, tensors = weights_equal(reference["weights"], summary["weights"])
    made = [e for e in events if e["killed"]]
    return {
        "steps": steps, "seed": seed, "reference_train_s": round(train_s, 2), "kills": len(made), "aimed_at_writes": sum(e["kind"] == "write" for e in made),
        "landed_in_writes": sum(e["in_write"] for e in made), "ended_before_kill": len(events) - len(made),
        "bit_equal": equal, "tensors": tensors, "partial_files_left": partial_writes(out),
        "final_steps": summary["steps"], "events": events,
    }


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun's agent started (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    ranks = {}
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def torchrun_worker_kill(workdir: Path, steps: int = 20, fsdp: bool = False) -> dict:
    """2 processes under torchrun --max-restarts 1 (``fsdp``: sharded with FSDP, else DDP): an
    uninterrupted run, and one whose rank 1 is SIGKILLed while rank 0 writes the second
    checkpoint; the report."""
    data, cache = make_data(workdir / "images"), workdir / "cache"
    reference_out, out = workdir / "reference2", workdir / "killed2"
    sharding = ["--fsdp"] if fsdp else []
    proc = launch(train_args(data, reference_out, cache, steps) + sharding, environment(), torchrun=2)
    code, stdout, stderr = finish(proc)
    if code != 0:
        raise RuntimeError(f"the uninterrupted 2-process run failed:\n{stderr[-3000:]}")
    reference = last_json(stdout)

    # every write is held open for a while: the kill lands while rank 1 waits for rank 0's write
    proc = launch(train_args(data, out, cache, steps) + sharding, environment(), torchrun=2, max_restarts=1,
                  hold_writes=HOLD_S)
    wait_for(lambda: len(checkpoints(out)) >= 1 and bool(partial_writes(out)), proc)
    victims = worker_pids(proc.pid)
    os.kill(victims[1], signal.SIGKILL)
    killed_at = checkpoints(out)
    code, stdout, stderr = finish(proc)
    if code != 0:
        raise RuntimeError(f"the restarted 2-process run failed:\n{stderr[-3000:]}")
    summary = last_json(stdout)
    resumed = [line for line in stderr.splitlines() if "torchrun restart" in line]
    equal, tensors = weights_equal(reference["weights"], summary["weights"])
    return {"steps": steps, "killed_rank": 1, "checkpoints_at_kill": killed_at, "restart_lines": resumed,
            "bit_equal": equal, "tensors": tensors, "world_size": summary["world_size"],
            "final_steps": summary["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs in all")
    parser.add_argument("--write-kills", type=int, default=2, help="of them, aimed inside a checkpoint write")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torchrun", action="store_true", help="the 2-process torchrun restart instead")
    parser.add_argument("--fsdp", action="store_true", help="with --torchrun: the processes shard the model (FSDP)")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        t0 = time.monotonic()
        if args.torchrun:
            report = torchrun_worker_kill(workdir, fsdp=args.fsdp)
        else:
            report = kill_and_resume(workdir, args.kills, min(args.write_kills, args.kills), args.seed, args.steps)
        report["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
