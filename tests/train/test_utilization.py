"""The training summary's model-FLOPs utilisation: what a GPU run reports and a CPU run leaves
out, with the figures injected (no GPU needed), and which steps its rate times."""
from __future__ import annotations

import pytest
import torch

from vitlab.analysis.cost import model_flops
from vitlab.models.registry import get_config
from vitlab.train.loop import StepRate, utilization_summary


def never(*args):
    raise AssertionError("a CPU run must not measure a peak")


def test_a_cpu_run_reports_no_utilization_and_measures_no_peak():
    assert utilization_summary(torch.device("cpu"), 1e9, 100.0, never) == {}


def test_a_gpu_run_reports_its_flops_rate_peak_and_mfu():
    flops = 3 * model_flops(get_config("ViT-B/16"))  # 3 x 35.1 GFLOPs per 224-px image
    peaks = []
    fields = utilization_summary(torch.device("cuda"), flops, 3000.0, lambda: peaks.append(1) or 700e12)
    assert peaks == [1]  # measured once
    assert fields["train_flops_per_image"] == flops
    assert fields["step_images_per_s"] == 3000.0
    assert fields["achieved_tflops"] == pytest.approx(flops * 3000 / 1e12, rel=1e-3)
    assert fields["peak_bf16_tflops"] == 700.0
    assert fields["mfu"] == pytest.approx(flops * 3000 / 700e12, rel=1e-3)
    small = utilization_summary(torch.device("cuda"), 1e7, 5000.0, lambda: 700e12)  # a CIFAR-size model's
    assert small["mfu"] > 0 and small["mfu"] == pytest.approx(1e7 * 5000 / 700e12, rel=1e-3)  # not rounded away
    assert 0.4 < fields["mfu"] < 0.5  # the injected 316 TFLOP/s of 700


def test_a_gpu_run_without_timed_steps_or_peak_reports_none_rather_than_a_guess():
    untimed = utilization_summary(torch.device("cuda"), 1e9, None, never)  # no full-size step timed: no peak taken
    assert untimed["train_flops_per_image"] == 10**9
    assert untimed["step_images_per_s"] is untimed["mfu"] is untimed["peak_bf16_tflops"] is None
    no_room = utilization_summary(torch.device("cuda"), 1e9, 100.0, lambda: None)  # the peak ran out of memory
    assert no_room["achieved_tflops"] == 0.1 and no_room["mfu"] is None


def test_the_rate_times_full_size_steps_after_two_and_not_after_a_change_of_size():
    rate = StepRate(torch.device("cpu"), full_size=(32, 32))
    counted = []
    for size in (32, 32, 32, 24, 24, 32, 32, 32):
        start = rate.start((size, size))
        counted.append(start is not None)
        rate.stop(start, images=8)
    rate.take()
    # the first two (compilation), the smaller phase, and the first step back at full size are left out
    assert counted == [False, False, True, False, False, False, True, True]
    assert rate.images == 3 * 8 and rate.seconds >= 0
    rate.take()
    assert rate.images == 24  # each step's time is counted once
