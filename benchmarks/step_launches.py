"""How many operators the host dispatches per training step, outside the model's compiled graph.

    python benchmarks/step_launches.py --data ../shared/data/cifar10/cifar10-train.tar.gz
    python benchmarks/step_launches.py --data ../shared/data/cifar10/cifar10-train.tar.gz \
        --set data.augment_batches=1                                      # each batch augmented on its own

On a GPU the forward and backward replay as one CUDA graph, while the data path (the next
batch's augmentation) and an eager optimiser step launch one kernel per operator from the
host; when those launches take longer than the graph's device time, the device waits
(``data_wait`` in the run's summary).  This counts them on a CPU: the run is built as
``vitlab train`` builds it (``--recipe``, by default the CIFAR recipe's GPU form, ``--set``
changes it), on the CPU and eager, and a ``TorchDispatchMode`` counts the aten operators
that do work (views and allocations left out) while ``--batches`` batches are drawn and
while one optimiser update runs.  A count, not a timing: it is the same on any CPU.  One
JSON line last.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitlab.configs import load_recipe
from vitlab.train.build import build
from vitlab.train.overrides import apply_overrides, with_changes

# operators that launch no kernel: views, metadata and allocations
NO_KERNEL = {"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand", "slice", "select",
             "unsqueeze", "squeeze", "alias", "detach", "unbind", "split", "split_with_sizes", "narrow", "reshape",
             "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like"}


class Launches(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in NO_KERNEL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="cifar10_scratch:model=vit,device=cuda")
    p.add_argument("--data", default=None, help="the recipe's data.source (default: the recipe's own)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="as vitlab train --set")
    p.add_argument("--batches", type=int, default=16, help="batches whose drawing is counted")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    changes = {"run.out": "/tmp/step-launches", "run.time_limit": 0.0, "run.tensorboard": False,
               "run.eval_every": 0, "run.device": "cpu", "run.compile": False, "run.compile_optimizer": False}
    if args.data:
        changes["data.source"] = args.data
    setup = build(apply_overrides(with_changes(load_recipe(args.recipe), changes), args.set))
    batches = iter(setup.stream)
    x, y = next(batches)
    with Launches() as drawing:
        for _ in range(args.batches):
            x, y = next(batches)

    def backward() -> None:
        setup.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(setup.trained(x[:8]).float(), y[:8]).backward()

    no_bad_rank = torch.zeros(1)
    backward()
    setup.update(no_bad_rank)  # the optimiser's state is made at its first step
    backward()
    with Launches() as update:
        setup.update(no_bad_rank)
    report = {"recipe": args.recipe, "sets": args.set, "batch": setup.cfg.optim.batch_size,
              "augment_batches": setup.cfg.data.augment_batches,
              "data_path_per_batch": drawing.kernels() / args.batches, "optimiser_update": update.kernels(),
              "optimiser_top": dict(update.ops.most_common(6))}
    print(f"data path: {report['data_path_per_batch']:.1f} operators per batch "
          f"(augment_batches={report['augment_batches']}); optimiser update: {report['optimiser_update']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
