"""bf16 autocast's dense layers computed by the fp32 GEMM (vitlab/models/bf16_matmul.py)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitlab.config import ViTConfig
from vitlab.models import bf16_matmul as bm
from vitlab.models.layers import Block

BF16 = torch.bfloat16


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).double()


def assert_is_bf16_rounding_of(result: torch.Tensor, exact: torch.Tensor) -> None:
    """``result`` is ``exact`` rounded to bf16: everywhere within one bf16 step, and equal to
    the rounding except where fp32 accumulation error meets a rounding boundary."""
    assert result.dtype == BF16
    expected = exact.to(BF16)
    step = exact.abs().clamp_min(1e-30) * 2.0**-7
    assert ((result.double() - exact).abs() <= step).all()
    assert (result == expected).double().mean() > 0.99


def test_linear_is_autocasts_linear_on_bf16_values():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(64, 384), torch.randn(96, 384), torch.randn(96)
    out = bm.linear(x, weight, bias)
    # bf16 products are exact in fp32, so the reference is exact arithmetic on the rounded values
    assert_is_bf16_rounding_of(out, rounded(x) @ rounded(weight).t() + rounded(bias))
    with torch.autocast("cpu", BF16), bm.bf16_matmul("bf16"):
        native = torch.nn.functional.linear(x, weight, bias)
    assert_is_bf16_rounding_of(native, rounded(x) @ rounded(weight).t() + rounded(bias))


def test_widened_gradients_are_autocasts_on_bf16_values():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 256, requires_grad=True)
    weight = torch.randn(48, 256, requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    grad_out = torch.randn(4, 16, 48).to(BF16)
    out = bm.widened_linear(x, weight, bias)
    out.backward(grad_out)
    g, rows = grad_out.double().reshape(-1, 48), rounded(x).reshape(-1, 256)
    assert x.grad.dtype == weight.grad.dtype == torch.float32  # cast to the inputs' dtype, as autocast's are
    assert_is_bf16_rounding_of(x.grad.to(BF16), (g @ rounded(weight)).view(4, 16, 256))
    assert_is_bf16_rounding_of(weight.grad.to(BF16), g.t() @ rows)
    assert_is_bf16_rounding_of(bias.grad.to(BF16), g.sum(0))
    # bf16 values: the weight gradient is rounded where the bf16 kernel's output would be
    assert torch.equal(weight.grad, weight.grad.to(BF16).float())


def test_a_frozen_input_gets_no_gradient_and_the_weights_get_theirs():
    torch.manual_seed(0)
    x, weight = torch.randn(8, 32), torch.randn(16, 32, requires_grad=True)
    grad_out = torch.randn(8, 16).to(BF16)
    bm.widened_linear(x, weight, None).backward(grad_out)
    assert x.grad is None
    assert_is_bf16_rounding_of(weight.grad.to(BF16), grad_out.double().t() @ rounded(x))
    assert bm.dense_backward(grad_out, x, weight.detach(), True, False, needs_inputs=False)[0] is None


def test_results_never_alias_the_scratch_buffers():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    first_x, second_x = torch.randn(128, 64), torch.randn(128, 64)
    first = bm.linear(first_x, weight, None)
    kept = first.clone()
    bm.linear(second_x, weight, None)  # same shapes: the same scratch slots
    assert torch.equal(first, kept)
    grads = bm.dense_backward(torch.randn(128, 32).to(BF16), first_x, weight, True, True)
    kept_grads = [g.clone() for g in grads]
    bm.dense_backward(torch.randn(128, 32).to(BF16), second_x, weight, True, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads))
    bm.release_scratch()


class BF16Matmuls(TorchDispatchMode):
    """Counts the 2-D matmuls (mm, addmm) that run on bf16 operands."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += any(isinstance(a, torch.Tensor) and a.dtype == BF16 for a in args)
        return func(*args, **(kwargs or {}))


def _block_step(path: str) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    block = Block(ViTConfig(width=64, depth=1, mlp_dim=256, num_heads=4, gelu="exact"))
    x = torch.randn(2, 17, 64, requires_grad=True)
    with bm.bf16_matmul(path), BF16Matmuls() as counted:
        with torch.autocast("cpu", BF16):
            out = block(x)
        out.float().square().sum().backward()
    return out.detach(), [x.grad] + [p.grad for p in block.parameters()], counted.count


def test_a_training_step_through_the_fp32_gemm_has_no_bf16_dense_matmuls_and_the_same_result():
    out, grads, bf16_calls = _block_step("fp32")
    native_out, native_grads, native_calls = _block_step("bf16")
    assert bf16_calls == 0
    assert native_calls == 12  # 4 dense layers: forward, input and weight gradients
    # the same computation up to the order of fp32 additions: bf16-level agreement
    assert (out - native_out).norm() <= 2**-8 * native_out.norm()
    for grad, native in zip(grads, native_grads):
        assert (grad - native).norm() <= 2e-2 * native.norm()


def test_inference_keeps_the_weights_as_bf16_values_in_fp32():
    from vitlab.models.buffers import Dense

    torch.manual_seed(0)
    dense = Dense(64, 32)
    x = torch.randn(8, 64)
    with torch.no_grad():
        with torch.autocast("cpu", BF16), bm.bf16_matmul("fp32"):
            out = dense(x)
        assert torch.equal(out, bm.linear(x, dense.weight, dense.bias))
    assert dense._cast[1].dtype == torch.float32


def test_the_path_follows_the_environment_and_the_context_manager(monkeypatch):
    monkeypatch.setenv("VITLAB_BF16_MATMUL", "fp32")
    assert bm.fp32_gemm_is_faster()
    monkeypatch.setenv("VITLAB_BF16_MATMUL", "bf16")
    assert not bm.fp32_gemm_is_faster()
    with bm.bf16_matmul("fp32"):
        assert bm.fp32_gemm_is_faster()
        x = torch.randn(2, 3)
        assert not bm.widened(x)  # no autocast
        with torch.autocast("cpu", BF16):
            assert bm.widened(x)
        with torch.autocast("cpu", torch.float16):
            assert not bm.widened(x)
    monkeypatch.setenv("VITLAB_BF16_MATMUL", "fast")
    with pytest.raises(ValueError, match="VITLAB_BF16_MATMUL='fast'"):
        bm.fp32_gemm_is_faster()
    with pytest.raises(ValueError, match="expected one of auto, bf16, fp32"):
        with bm.bf16_matmul("tf32"):
            pass
