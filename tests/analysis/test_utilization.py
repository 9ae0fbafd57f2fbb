"""Model-FLOPs utilisation and the measured matmul peak it divides by."""
from __future__ import annotations

import math

import pytest
import torch

from vitlab.analysis.cost import core_days, training_flops
from vitlab.analysis.utilization import matmul_peak, mfu
from vitlab.models.registry import get_config


def test_mfu_is_the_achieved_rate_over_the_peak():
    assert mfu(1e9, 100.0, 4e11) == pytest.approx(0.25)
    assert mfu(1e9, 0.0, 4e11) == 0.0
    for bad in (dict(peak_flops_per_s=0.0), dict(peak_flops_per_s=math.nan), dict(images_per_s=-1.0),
                dict(flops_per_image=math.inf)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mfu(**{**dict(flops_per_image=1e9, images_per_s=100.0, peak_flops_per_s=4e11), **bad})


def test_a_run_at_its_mfu_takes_the_core_days_the_cost_model_gives():
    """``mfu`` and ``cost.core_days`` describe one run alike: N images at r img/s on a device of
    peak P take N / r seconds, which is the run's FLOPs at utilisation mfu on that peak."""
    cfg, images, rate, peak = get_config("ViT-B/16"), 10_000_000, 2500.0, 700e12
    exaflops = training_flops(cfg, steps=images // 1000, batch=1000)
    flops_per_image = exaflops * 1e18 / images  # 3 x the forward
    assert core_days(exaflops, peak, mfu(flops_per_image, rate, peak)) == pytest.approx(images / rate / 86400)


@pytest.mark.parametrize("grad", [True, False])
def test_the_peak_on_a_cpu_is_a_rate_and_leaves_the_process_as_it_was(grad):
    threads = torch.get_num_threads()
    torch.manual_seed(1)
    expected_next = torch.rand(3)
    torch.manual_seed(1)
    with torch.set_grad_enabled(grad):
        peak = matmul_peak("cpu", torch.float32, size=64, warmup=1, repeats=3)
        assert torch.is_grad_enabled() is grad
    assert torch.equal(torch.rand(3), expected_next)  # the matrices drew from a generator of their own
    assert torch.get_num_threads() == threads
    assert math.isfinite(peak.best) and peak.best >= peak.median > 0 and peak.calls >= 1


def test_the_peak_times_what_it_is_given_and_counts_each_product():
    calls = []
    peak = matmul_peak("cpu", size=16, warmup=2, repeats=3, min_seconds=0.0, product=lambda: calls.append(1))
    assert len(calls) == 2 + 3 * peak.calls and peak.calls == 1
    bf16 = matmul_peak("cpu", torch.bfloat16, size=32, warmup=1, repeats=1)  # the default dtype, small
    assert bf16.best > 0
    with pytest.raises(ValueError, match="repeats=0"):
        matmul_peak("cpu", size=8, repeats=0)
