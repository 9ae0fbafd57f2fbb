"""``step.HeldGradients``: the gradients moved out of a CUDA graph's memory after each backward
(where a compiled call after the backward would free them: the compiled update, the next
micro-batch's forward).  The move must change no number: a run holding its gradients trains
as one that does not, bit for bit; each parameter's gradient is then its own buffer, at one
address from step to step.  Under CUDA graphs, where the run decides to hold them,
``tests/test_cuda.py`` checks it."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from vitlab.train.build import build
from vitlab.train.step import HeldGradients, endless, train_step

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="inductor needs a C++ compiler on a CPU")


class Net(nn.Module):
    """Two dense layers and one that no loss reaches (its gradients stay None)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def micro_batch_backward(model: nn.Module, step: int, micro: int) -> None:
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    (nn.functional.cross_entropy(model(x), y) / 2).backward()


def test_held_gradients_are_the_accumulated_gradients_in_buffers_of_one_address():
    torch.manual_seed(0)
    plain, holding = Net(), Net()
    holding.load_state_dict(plain.state_dict())
    held = HeldGradients(holding.parameters())
    addresses = [b.data_ptr() for b in held.buffers]
    for step in range(3):
        for micro in range(2):  # two micro-batches: the second backward adds to the held gradients
            micro_batch_backward(plain, step, micro)
            micro_batch_backward(holding, step, micro)
            held.take()
        named = dict(holding.named_parameters())
        for (name, p), buffer in zip(named.items(), held.buffers):
            if name.startswith("unused"):
                assert p.grad is None  # no gradient is made up
            else:
                assert p.grad is buffer
        for (name, p), q in zip(plain.named_parameters(), holding.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(q.grad, p.grad), name  # a copy and the same in-place sum: the same bits
        plain.zero_grad(set_to_none=True)
        holding.zero_grad(set_to_none=True)
    assert [b.data_ptr() for b in held.buffers] == addresses


def test_a_run_that_holds_its_gradients_trains_as_one_that_does_not(tiny):
    """Through the trainer, with gradient accumulation (2 micro-batches a step): the same losses,
    gradient norms and weights to the bit."""
    runs = [build(tiny(name, accum_steps=2, tensorboard=False)) for name in ("plain", "holding")]
    plain, holding = runs
    assert plain.held_gradients is None  # eager, on a CPU: nothing a compiled call could free
    holding.held_gradients = HeldGradients(holding.trained.parameters())
    results = {}
    for s in runs:
        batches = endless(s.stream)
        results[id(s)] = [train_step(s, batches, lr=lr, size=s.img_size[0]).read() for lr in (3e-3, 1e-3, 2e-3)]
    for got, expected in zip(results[id(holding)], results[id(plain)]):
        assert (got.loss, got.grad_norm) == (expected.loss, expected.grad_norm)
    for (name, v), w in zip(plain.model.state_dict().items(), holding.model.state_dict().values()):
        assert torch.equal(w, v), name


@pytest.mark.slow  # compiles
@needs_compiler
def test_the_compiled_update_reads_the_held_gradients_and_compiles_once(tiny):
    """The update compiled on its own (forced on the CPU, inductor's "default" mode) reading the
    held gradients, as a run under CUDA graphs does: one graph for every step (each gradient is
    the same buffer each step), and the eager update's weights."""
    torch._dynamo.reset()
    arch = {"model.qkv_bias": False}  # the key bias has no gradient but rounding, which Adam would magnify
    runs = [build(tiny(name, accum_steps=2, tensorboard=False, **arch, **{"run.compile_optimizer": on}))
            for name, on in (("eager", False), ("compiled", True))]
    eager, compiled = runs
    compiled.held_gradients = HeldGradients(compiled.trained.parameters())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for s in runs:
            batches = endless(s.stream)
            for lr in (3e-3, 1e-3, 2e-3, 1e-3):
                train_step(s, batches, lr=lr, size=s.img_size[0])
    assert compiled.update.compiled is not None  # nothing failed, nothing fell back
    for (name, v), w in zip(eager.model.state_dict().items(), compiled.model.state_dict().values()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()
