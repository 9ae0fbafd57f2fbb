import math

import pytest

from vitlab.train.schedules import fit_steps_to_time, input_size_at, lr_at, schedule_cost, step_cost


def test_warmup_endpoints():
    kw = dict(base_lr=1.0, total_steps=100, warmup_steps=10, decay="linear")
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)  # warm-up reaches the base lr at its last step
    assert lr_at(10, **kw) == pytest.approx(1.0)  # decay starts from the base lr
    assert lr_at(100, **kw) == pytest.approx(0.0)


def test_linear_and_cosine_midpoint():
    assert lr_at(55, base_lr=2.0, total_steps=100, warmup_steps=10, decay="linear") == pytest.approx(1.0)
    assert lr_at(55, base_lr=2.0, total_steps=100, warmup_steps=10, decay="cosine") == pytest.approx(1.0)
    # a quarter of the way: cosine is above linear
    assert lr_at(32.5, base_lr=1.0, total_steps=100, warmup_steps=10, decay="cosine") == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(99, base_lr=1.0, total_steps=100, warmup_steps=0, decay="cosine", min_lr=0.1) > 0.1
    assert lr_at(100, base_lr=1.0, total_steps=100, warmup_steps=0, decay="cosine", min_lr=0.1) == pytest.approx(0.1)
    assert lr_at(50, base_lr=1.0, total_steps=100, warmup_steps=5, decay="constant") == 1.0


def test_lr_is_a_pure_function_of_the_step():
    kw = dict(base_lr=3e-3, total_steps=1000, warmup_steps=100, decay="cosine")
    assert [lr_at(s, **kw) for s in range(0, 1000, 37)] == [lr_at(s, **kw) for s in range(0, 1000, 37)]


def test_time_fitted_total():
    # 600 s budget, 60 s gone at step 12, 0.5 s/step, final eval 10 s, 5 s reserve:
    # (600 - 60 - 10 - 5) / 0.5 = 1050 more steps
    assert fit_steps_to_time(budget_s=600, elapsed_s=60, step=12, sec_per_step=0.5, eval_s=10,
                             reserve_s=5) == 12 + 1050
    # periodic evaluation every 100 steps adds 0.1 s per step
    assert fit_steps_to_time(budget_s=600, elapsed_s=60, step=12, sec_per_step=0.5, eval_s=10, eval_every=100,
                             reserve_s=5) == 12 + int(525 // 0.6)
    # a final evaluation with 5x the views costs 50 s: (600 - 60 - 50 - 5) / 0.6
    assert fit_steps_to_time(budget_s=600, elapsed_s=60, step=12, sec_per_step=0.5, eval_s=10, eval_every=100,
                             final_eval_s=50, reserve_s=5) == 12 + int(485 // 0.6)
    assert fit_steps_to_time(budget_s=10, elapsed_s=60, step=12, sec_per_step=0.5) == 13  # over budget: one more
    assert fit_steps_to_time(budget_s=600, elapsed_s=0, step=0, sec_per_step=0.1, max_steps=50) == 50


def test_progressive_sizes_follow_the_phases():
    phases, full = ((16, 0.25), (24, 0.5)), (32, 32)
    sizes = [input_size_at(s, 100, phases, full) for s in range(100)]
    assert sizes == [(16, 16)] * 25 + [(24, 24)] * 25 + [(32, 32)] * 50
    # the boundaries move with the schedule's length
    assert [input_size_at(s, 10, phases, full)[0] for s in (2, 3, 4, 5)] == [16, 24, 24, 32]
    assert input_size_at(0, 100, (), full) == (32, 32)


def test_a_non_square_run_trains_at_its_height_and_width_at_full_cost():
    """Without phases the images are the run's (H, W): its side alone (16) squashed 16x24 images to
    16x16, and a step counted 16*16/(16*24) of a full one in the time budget."""
    assert input_size_at(0, 10, (), (16, 24)) == (16, 24)
    assert step_cost((16, 24), (16, 24)) == 1.0
    assert schedule_cost(0, 10, (), (16, 24)) == 10.0


@pytest.mark.parametrize("phases", [((24, 0.75),), ((16, 0.25), (24, 0.5)), ((8, 0.1), (16, 1.0))])
@pytest.mark.parametrize("total", [1, 7, 100, 1001])
def test_schedule_cost_sums_the_steps(phases, total):
    full = (32, 32)
    for start in {0, 1, total // 3, total - 1}:
        by_step = sum(step_cost(input_size_at(s, total, phases, full), full) for s in range(start, total))
        assert schedule_cost(start, total, phases, full) == pytest.approx(by_step)
    assert step_cost((24, 24), full) == pytest.approx(0.5625)


def test_time_fitted_total_with_cheaper_steps():
    kw = dict(budget_s=600, elapsed_s=60, step=12, sec_per_step=0.5, eval_s=10, eval_every=100, reserve_s=5)
    # unit cost per step: the uniform answer
    assert fit_steps_to_time(**kw, steps_cost=lambda a, n: n - a) == fit_steps_to_time(**kw)
    # three quarters of the steps at 24 of 32 pixels: the largest total that fits, and no larger
    phases, full = ((24, 0.75),), (32, 32)
    cost = lambda a, n: schedule_cost(a, n, phases, full)
    total = fit_steps_to_time(**kw, steps_cost=cost)
    left = 600 - 60 - 10 - 5

    def needs(n):
        return 0.5 * cost(12, n) + 0.1 * (n - 12)

    assert needs(total) <= left < needs(total + 1)
    assert total > 1.3 * fit_steps_to_time(**kw)
    assert fit_steps_to_time(**kw, steps_cost=cost, max_steps=1000) == 1000


def _paper(step: int, base: float, total: int, warmup: int, decay: str) -> float:
    """The paper's schedule written out (vit_jax's, its step counted from 1): linear warm-up to
    ``base`` over ``warmup`` steps, then linear or cosine decay to 0 at step ``total``."""
    s = step + 1
    if s <= warmup:
        return base * s / warmup
    progress = (s - 1 - warmup) / (total - warmup)  # this library's decay starts from base at 0-based step warmup
    return base * (1 - progress if decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("recipe, base, total, decay", [
    ("paper_pretrain", 8e-4, 517_000, "linear"), ("paper_pretrain:dataset=i21k", 1e-3, 312_000, "linear"),
    ("paper_pretrain_imagenet", 3e-3, 93_835, "cosine")])
def test_the_paper_recipes_schedules_at_chosen_steps(recipe, base, total, decay):
    from vitlab.configs import load_recipe
    from vitlab.train.schedules import warmup_steps

    optim = load_recipe(recipe).optim
    assert (optim.lr, optim.steps, optim.decay, optim.min_lr) == (base, total, decay, 0.0)
    warmup = warmup_steps(optim, optim.steps)
    assert warmup == 10_000
    kw = dict(base_lr=optim.lr, total_steps=optim.steps, warmup_steps=warmup, decay=optim.decay)
    for step in (0, 1, 4_999, 9_998, 9_999, 10_000, 10_001, 50_000, total // 2, total - 2, total - 1):
        assert lr_at(step, **kw) == pytest.approx(_paper(step, base, total, 10_000, decay), rel=1e-12, abs=1e-18)
    assert lr_at(9_999, **kw) == lr_at(10_000, **kw) == base  # the end of warm-up is the peak
    assert 0 < lr_at(total - 1, **kw) < base * 1e-4  # the last step: just above 0


def test_a_run_steps_at_the_scheduled_rates(tiny, monkeypatch):
    import vitlab.train.loop as loop
    from vitlab.train import train

    rates, real_step = [], loop.train_step

    def train_step(setup, batches, lr, size):
        result = real_step(setup, batches, lr, size)
        rates.append([group["lr"] for group in setup.optimizer.param_groups])
        return result

    monkeypatch.setattr(loop, "train_step", train_step)
    train(tiny(steps=6, warmup=2, decay="linear", lr=3e-3), verbose=False)
    # warm-up over 2 steps, then linear decay over the 4 left: 1/2, 1, 1, 3/4, 1/2, 1/4 of the base rate
    expected = [3e-3 * f for f in (0.5, 1.0, 1.0, 0.75, 0.5, 0.25)]
    assert rates == [pytest.approx([r, r]) for r in expected]
