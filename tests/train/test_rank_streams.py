"""Each process of a multi-process run draws from a stream of its own once the model is built
(dropout, the steps' draws), and a checkpoint keeps every rank's: seeded alike, every rank drew the
same dropout masks for its own examples, and a checkpoint held rank 0's state, which every rank took."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vitlab.train.distributed import World
from vitlab.train.state import rank_seed, restore_rank_rng, rng_state

BUILD = """
import hashlib, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from conftest import tiny_config
from vitlab.machine import Machine
from vitlab.train.build import build
from vitlab.train.distributed import World
from vitlab.train.state import set_rng_state
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
world = World(rank=rank, size=2, local_rank=rank, device=torch.device("cpu"), processes_here=2)
setup = build(tiny_config(store + ".run", batch_size=32), world, Machine.described(cores=2))
weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in setup.model.parameters())).hexdigest()
set_rng_state(setup.rng)
mask = torch.nn.functional.dropout(torch.ones(64), 0.5)
print(weights, "".join("1" if v else "0" for v in mask.tolist()))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_processes_of_a_run_share_the_weights_and_draw_their_own_dropout(tmp_path):
    root, tests = Path(__file__).resolve().parents[2], str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(rank), str(tmp_path / "store"), tests], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    (weights0, mask0), (weights1, mask1) = (out.split()[-2:] for out, _ in outs)
    assert weights0 == weights1  # the model is every rank's
    assert mask0 != mask1  # the masks are each rank's own


def test_a_checkpoint_gives_each_rank_its_own_stream_back():
    def world(rank, size):
        return World(rank=rank, size=size, local_rank=rank, device=torch.device("cpu"), processes_here=size)

    caller = rng_state()
    try:
        streams = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            streams.append(rng_state())
        state = {"rng": streams[0], "rng_ranks": streams, "step": 10, "config": {"run": {"seed": 0}}}
        draws = {}
        for rank in (0, 1):
            restore_rank_rng(state, world(rank, 2))
            draws[rank] = torch.rand(3)
        torch.manual_seed(2)
        assert torch.equal(draws[1], torch.rand(3))  # rank 1's own saved stream
        # a checkpoint of another process count (or of before each rank's was kept): rank 0's, and on
        # another rank a stream of its own from that step
        restore_rank_rng(state, world(0, 3))
        first = torch.rand(3)
        restore_rank_rng(state, world(1, 3))
        other = torch.rand(3)
        torch.manual_seed(rank_seed(0, 1, 10))
        assert torch.equal(other, torch.rand(3)) and not torch.equal(first, other)
        assert rank_seed(5, 0) == 5 and len({rank_seed(5, r) for r in range(1, 9)}) == 8
    finally:
        from vitlab.train.state import set_rng_state

        set_rng_state(caller)
