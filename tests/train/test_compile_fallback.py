"""A compiled training step that fails is redone eagerly on the same micro-batches, with a warning."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vitlab.train.build import build
from vitlab.train.step import endless, train_step


class FailingCompiled(nn.Module):
    """Stands in for torch.compile's wrapper whose compiled kernel refuses the input."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        raise AssertionError("expected size 256==256, stride 36864==9216 at dim=0")


def test_a_failing_compiled_step_falls_back_to_eager_on_the_same_batches(tiny):
    cfg = tiny(steps=2, accum_steps=2)
    s, twin = build(cfg), build(cfg)  # the same seed: the same weights and batches
    batches, twin_batches = endless(s.stream), endless(twin.stream)
    s.trained = FailingCompiled(s.model)
    with pytest.warns(RuntimeWarning, match="torch.compile failed .*AssertionError.*training continues eager"):
        result = train_step(s, batches, lr=1e-3, size=s.img_size[0])
    assert s.trained is s.model  # eager from now on
    expected = train_step(twin, twin_batches, lr=1e-3, size=twin.img_size[0])
    # the losses are 0-d tensors: compared as tensors (pytest.approx refuses them since pytest 9)
    torch.testing.assert_close(result.loss, expected.loss, rtol=1e-6, atol=0.0)
    assert result.seen == expected.seen
    for p, q in zip(s.model.parameters(), twin.model.parameters()):
        torch.testing.assert_close(p, q)
    # and the stream went on from where the eager twin's did
    torch.testing.assert_close(next(batches)[0], next(twin_batches)[0])


def test_an_eager_step_that_fails_is_not_retried(tiny):
    s = build(tiny(steps=2))
    s.trained = copy.deepcopy(s.model)
    s.trained.forward = lambda x: (_ for _ in ()).throw(ValueError("a real bug"))
    with pytest.raises(ValueError, match="a real bug"):
        train_step(s, endless(s.stream), lr=1e-3, size=s.img_size[0])
