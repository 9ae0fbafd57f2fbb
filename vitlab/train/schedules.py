"""Learning rate as a pure function of the step, and fitting a run into a time budget.

The paper (Table 3, Table 4): linear warm-up over 10k steps (pre-training) or 500
(fine-tuning), then linear or cosine decay towards zero (``min_lr``), which step
``total_steps`` would reach: the last step taken, ``total_steps - 1``, is just above it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .config import OptimConfig


def lr_at(step: int, *, base_lr: float, total_steps: int, warmup_steps: int,
          decay: str = "cosine", min_lr: float = 0.0) -> float:
    """The learning rate of optimiser step ``step`` (0-based).

    Warm-up rises linearly to ``base_lr``, reaching it at step ``warmup_steps`` (step 0
    already gets base_lr / warmup_steps, so no step is wasted at lr 0, as in big_vision).
    Then "linear" or "cosine" decay takes it to ``min_lr`` at step ``total_steps``, or
    "constant" keeps it.  The last step, total_steps - 1, is just above ``min_lr``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay == "constant":
        return base_lr
    span = max(total_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)  # 0 after warm-up, 1 at the end
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"decay={decay!r}: allowed values are 'cosine', 'linear', 'constant'")
    return min_lr + (base_lr - min_lr) * shape


def scaled_warmup(warmup: float, steps: int, recipe_steps: int) -> float:
    """The warm-up of a schedule of ``steps`` steps, given ``warmup`` for ``recipe_steps``.

    The rule: a fraction (< 1) is a fraction of any schedule; a count (>= 1) is the
    warm-up of ``recipe_steps`` steps and keeps its share of a shorter schedule, rounded
    and at least one step (the paper's 500 fine-tuning warm-up steps of 10,000 are 5 of
    100); a longer schedule keeps the count (the paper's 10k steps for any pre-training).
    """
    if warmup < 1 or steps >= recipe_steps:
        return warmup
    return max(1, int(round(warmup * steps / recipe_steps)))


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """``optim.warmup`` as a step count in a schedule of ``total_steps`` steps
    (``scaled_warmup``: a fraction of it; a count scaled down with a schedule shorter than
    ``optim.steps``, as one fitted to ``run.time_limit``)."""
    if optim.warmup < 1:
        return int(round(optim.warmup * total_steps))
    return int(scaled_warmup(optim.warmup, total_steps, optim.steps))


def fit_steps_to_time(*, budget_s: float, elapsed_s: float, step: int, sec_per_step: float,
                      eval_s: float = 0.0, eval_every: int = 0, reserve_s: float = 0.0,
                      final_eval_s: float | None = None, max_steps: int | None = None,
                      steps_cost: Callable[[int, int], float] | None = None) -> int:
    """Total number of optimiser steps that ends the run, final evaluation included, by
    the deadline.

    budget_s:     the whole run's wall-clock budget, counted from its start.
    elapsed_s:    wall time spent so far (set-up, data loading, ``step`` steps done).
    sec_per_step: measured seconds per optimiser step.
    eval_s:       measured seconds of one evaluation pass; one runs at the end, and one
                  every ``eval_every`` steps (0: only at the end).
    reserve_s:    kept free for saving weights, plots and slack.
    final_eval_s: seconds of the final evaluation, if it costs more than the periodic
                  ones (more test-time views); default ``eval_s``.

    steps_cost:   ``steps_cost(start, total)``, the cost of steps start .. total-1 of a
                  schedule of ``total`` steps in full-cost steps (progressive resizing:
                  ``schedule_cost``); ``sec_per_step`` is then a full-cost step's.
                  Default: every step costs one.

    Each further step costs sec_per_step + eval_s / eval_every, so
        total = step + floor((budget - elapsed - final_eval_s - reserve) / that cost),
    at least ``step + 1`` (and at most ``max_steps``); with ``steps_cost``, the largest
    total whose steps and evaluations fit in the same time.
    """
    left = budget_s - elapsed_s - (eval_s if final_eval_s is None else final_eval_s) - reserve_s
    per_eval_step = eval_s / eval_every if eval_every > 0 else 0.0
    cost = sec_per_step + per_eval_step
    more = max(int(left // cost), 1) if cost > 0 else 1
    total = step + more
    if steps_cost is not None and cost > 0:
        def fits(n: int) -> bool:
            return sec_per_step * steps_cost(step, n) + per_eval_step * (n - step) <= left

        # cheaper steps only add to the uniform answer; the time grows with n, so bisect
        lo, hi = total, total
        while fits(hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        total = lo
    return min(total, max_steps) if max_steps is not None else total


def input_size_at(step: int, total_steps: int, phases: tuple, full: tuple[int, int]) -> tuple[int, int]:
    """(H, W) of the training images at optimiser step ``step`` (progressive resizing).

    ``phases`` = ((size, until), ...): ``size`` x ``size`` while step < until * total_steps,
    phase by phase; after the last, ``full`` (which may be non-square: then there are no
    phases).  FFCV's ImageNet recipes grow the resolution during training the same way; a
    phase boundary moves with ``total_steps``.
    """
    for size, until in phases:
        if step < until * total_steps:
            return (int(size), int(size))
    return (int(full[0]), int(full[1]))


def step_cost(size: tuple[int, int], full: tuple[int, int]) -> float:
    """A step's cost at ``size`` (H, W) relative to one at ``full``: the pixel count's ratio, which
    the CIFAR hybrid's measured step times follow (``python benchmarks/hybrid.py sizes``)."""
    return size[0] * size[1] / (full[0] * full[1])


def schedule_cost(start: int, total: int, phases: tuple, full: tuple[int, int]) -> float:
    """The cost of steps start .. total-1 of a ``total``-step schedule with progressive
    resizing ``phases`` (see ``input_size_at``), in full-size steps."""
    cost, begin = 0.0, 0
    squares = [((int(side), int(side)), until) for side, until in phases]
    for size, until in (*squares, (tuple(full), 1.0)):
        end = total if until >= 1.0 else min(math.ceil(until * total), total)
        lo = max(begin, start)
        if end > lo:
            cost += (end - lo) * step_cost(size, full)
        begin = max(begin, end)
    return cost
