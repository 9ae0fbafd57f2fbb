"""The step after the backward compiled (``run.compile_optimizer``, ``step.Update``): the
clipping, the decision to leave a step out, the optimiser and the EMA traced into one graph
(``optim.TracedStep``) give what the eager step, with torch's fused kernels, gives; a new
learning rate compiles nothing; a non-finite step moves nothing; a compiled update that fails
falls back to the eager one.  Forced on the CPU here (inductor, mode "default"); where a run
resolves it on its own, under CUDA graphs, ``tests/test_cuda.py`` checks it."""
from __future__ import annotations

import copy
import itertools
import shutil

import pytest
import torch
from torch import nn

from vitlab.train.build import build
from vitlab.train.config import OptimConfig
from vitlab.train.ema import EMA
from vitlab.train.optim import build_optimizer
from vitlab.train.step import Update, endless, train_step

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="inductor needs a C++ compiler on a CPU")
RATES = (1e-2, 3e-2, 2e-2, 5e-3, 1e-2)  # a new rate every step: each must reach the graph as a value


@pytest.fixture
def fresh_dynamo():
    """Dynamo with nothing compiled: another test's ``Update`` (another ``self``) compiled the same
    code, and this test's first call would count as its recompilation."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    """Two dense layers in ``blocks`` (Muon's matrices) and a head (AdamW's, under Muon)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


def twins(optimizer: str, mode: str, clip_norm: float = 0.1) -> tuple[Update, Update, nn.Module, nn.Module]:
    """An eager update and one in ``mode`` over two copies of one model, each with its own
    optimiser and EMA."""
    torch.manual_seed(0)
    model = Net()
    cfg = OptimConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, momentum=0.9, clip_norm=clip_norm)
    updates, models = [], []
    for update_mode in ("off", mode):
        m = copy.deepcopy(model)
        updates.append(Update(m.parameters(), build_optimizer(m, cfg), EMA(m, 0.9), m, clip_norm, update_mode))
        models.append(m)
    return updates[0], updates[1], models[0], models[1]


def backward(model: nn.Module, step: int, poisoned: bool = False) -> None:
    """A full-rank gradient (Muon's orthogonalisation magnifies rounding along a missing rank);
    ``poisoned``: a NaN in the batch, so the loss and every gradient are NaN."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 12, generator=g), torch.randint(0, 5, (64,), generator=g)
    if poisoned:
        x[3, 4] = float("nan")
    nn.functional.cross_entropy(model(x), y).backward()


def everything(update: Update) -> dict:
    """Every tensor the update may change: parameters, optimiser state, the EMA's weights."""
    tensors = {f"param.{i}": p for i, p in enumerate(update.params)}
    tensors |= {f"state.{i}.{k}": v for i, s in enumerate(update.optimizer.state.values()) for k, v in s.items()}
    tensors |= {f"ema.{k}": v for k, v in update.ema.module.state_dict().items()}
    return {k: v.detach().clone() for k, v in tensors.items()}


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "muon"])
@pytest.mark.slow  # compiles
@needs_compiler
def test_the_compiled_update_equals_the_eager_one_and_compiles_once(optimizer, fresh_dynamo):
    eager, compiled, eager_model, compiled_model = twins(optimizer, "default")
    start = everything(eager)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, lr in enumerate(RATES):
            numbers = []
            for update, model in ((eager, eager_model), (compiled, compiled_model)):
                backward(model, step, poisoned=step == 2)
                for group in update.optimizer.param_groups:  # as train_step sets them
                    group["lr"] = lr * group.get("lr_scale", 1.0)
                before = everything(update)
                numbers.append(update(torch.zeros(1)))  # no process's loss was bad
                update.optimizer.zero_grad(set_to_none=True)
                if step == 2:  # the NaN batch: no parameter, optimiser state or EMA weight moved
                    after = everything(update)
                    assert all(torch.equal(after[k], v) for k, v in before.items())
            (norm, skipped), (compiled_norm, compiled_skipped) = numbers
            assert float(skipped) == float(compiled_skipped) == (step == 2)
            if step != 2:
                assert float(norm) > 0.1  # the clipping is at work
                torch.testing.assert_close(compiled_norm, norm, rtol=1e-6, atol=0)
    assert compiled.compiled is not None  # nothing failed, nothing fell back
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # one graph for five rates
    got, expected = everything(compiled), everything(eager)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(expected["param.0"], start["param.0"])  # the steps did move the weights


@pytest.mark.slow  # compiles
@needs_compiler
def test_a_compiled_update_updates_the_state_a_checkpoint_loads(fresh_dynamo):
    # a resumed run's optimiser state is new tensors (load_state_dict): the update must take them up
    eager, compiled, eager_model, compiled_model = twins("adam", "default")
    for step, lr in enumerate(RATES):
        if step == 2:
            compiled.optimizer.load_state_dict(copy.deepcopy(compiled.optimizer.state_dict()))
        for update, model in ((eager, eager_model), (compiled, compiled_model)):
            backward(model, step)
            for group in update.optimizer.param_groups:
                group["lr"] = lr
            update(torch.zeros(1))
            update.optimizer.zero_grad(set_to_none=True)
    got, expected = everything(compiled), everything(eager)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_compiled_update_that_fails_falls_back_to_the_eager_one():
    eager, failing, eager_model, failing_model = twins("adam", "default")

    def refuse(bad_ranks):
        raise torch._dynamo.exc.Unsupported("a construct dynamo cannot trace")

    failing.compiled = refuse  # stands in for torch.compile's function, which fails before it runs
    with pytest.warns(RuntimeWarning, match=r"torch.compile of the optimizer step failed \(Unsupported: a construct "
                                            r"dynamo cannot trace\); the optimizer step continues eager"):
        for step in range(2):
            numbers = []
            for update, model in ((eager, eager_model), (failing, failing_model)):
                backward(model, step)
                numbers.append(torch.stack(update(torch.zeros(1))))
                update.optimizer.zero_grad(set_to_none=True)
            assert failing.compiled is None  # eager from the first step on
            assert torch.equal(numbers[1], numbers[0])  # [the gradient norm, skipped]
    for k, v in everything(eager).items():  # the same kernels on the same numbers: the very same weights
        assert torch.equal(everything(failing)[k], v), k


@pytest.mark.slow  # compiles
@needs_compiler
def test_a_run_with_its_optimizer_step_compiled_trains_as_the_eager_run(tiny, fresh_dynamo):
    """Through the trainer: resolved, built and stepped with ``train_step``'s learning rates;
    a NaN batch is left out (and reported) as the eager run leaves it out."""
    arch = {"model.qkv_bias": False}  # the key bias has no gradient but rounding, which Adam would magnify
    runs = [build(tiny(name, ema_decay=0.9, **arch, **{"run.compile_optimizer": on}))
            for name, on in (("eager", False), ("compiled", True))]
    eager, compiled = runs
    assert (eager.resolved.compile_optimizer, compiled.resolved.compile_optimizer) == ("off", "default")
    assert "(optimizer step default)" in compiled.resolved.line()
    results = {id(s): [] for s in runs}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in runs:
            batches = endless(s.stream)
            for step, lr in enumerate(RATES):
                if step == 2:  # a NaN image in this step's batch
                    x, targets = next(batches)
                    x[0] = float("nan")
                    batches = itertools.chain([(x, targets)], batches)
                results[id(s)].append(train_step(s, batches, lr=lr, size=s.img_size[0]).read())
    assert compiled.update.compiled is not None
    for got, expected in zip(results[id(compiled)], results[id(eager)]):
        assert (got.nonfinite, got.applied) == (expected.nonfinite, expected.applied)
        assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-5, nan_ok=True)
    assert [r.nonfinite for r in results[id(compiled)]] == [None, None, "loss", None, None]
    for got, expected in ((compiled.model, eager.model), (compiled.ema.module, eager.ema.module)):
        for (name, v), w in zip(expected.state_dict().items(), got.state_dict().values()):
            torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=name)
