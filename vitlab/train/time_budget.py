"""The time budget of a ``run.time_limit`` run: observe the step time, plan, decide when to stop.

With a time limit the number of steps is not known up front.  The loop reports each step
(``step_done``), every pause (evaluations, logging, checkpoints: ``paused``) and every
periodic evaluation's duration (``evaluated``); after each step it asks ``plan`` for the
total number of steps and ``out_of_time`` whether to stop now.  The plan:

1. time the steps after the first two (which pay for allocation and compilation) over
   ``measure_steps`` steps, time one evaluation, and fit the schedule so that the decay
   ends, and the final evaluation is done, by the deadline (``schedules.fit_steps_to_time``);
   fit after fewer steps (at least one) when the set-up left too little of the budget for
   all of them and the final evaluation;
2. time again over the rest of the warm-up (a steadier figure) and refit while the lr is
   still rising;
3. refit halfway through the decay (the warm-up's rate can be off by several percent on a
   machine still settling) and at three quarters (a shared machine that sped up after the
   halfway refit otherwise leaves minutes unused), early enough for the rest of the decay
   to absorb the change;
4. a slowdown after that is the guard's: ``out_of_time`` ends the run early, still with a
   final evaluation and a checkpoint.

A short budget (a few minutes, or less) may not hold the evaluations it plans for.  The
evaluation timed for the first fit is skipped when, estimated from the step time
(``eval_cost_steps``), it and the final evaluation would not fit in what is left; and a
final evaluation with more test-time views than the periodic ones (``final_eval_views``)
is reduced to the periodic views when those extra views would overrun the deadline
(``final_views_fit``), so that the command ends by the deadline rather than after it.

Times are read from ``clock`` and ranks agree through ``agree`` (the mean over ranks), so
the planner runs, and is tested, without a model or a process group.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from .schedules import fit_steps_to_time, schedule_cost, step_cost


class TimeBudget:
    """``minutes`` of wall time counted from ``started_at`` (a ``clock()`` reading).

    max_steps:     the ceiling of the plan (the configured steps).
    measure_steps: steps timed before the first fit.
    eval_every:    steps between periodic evaluations (0: the final one only).
    final_eval_views: the final evaluation's cost in periodic evaluations (more test-time views).
    eval_cost_steps: a periodic evaluation's estimated cost in training steps (0: unknown,
                   always timed); used when the budget is too short to time one.
    warmup:        ``warmup(total_steps)``: the warm-up's length in a schedule of that many steps.
    phases, full_size: progressive resizing (``data.progressive_sizes``) and the full training size;
                   steps are counted in full-size steps.
    agree:         the mean of a list of numbers over the ranks (identity in one process).
    say:           where the plan's messages go.
    """

    def __init__(self, minutes: float, started_at: float, *, max_steps: int, measure_steps: int, eval_every: int,
                 final_eval_views: float, warmup: Callable[[int], int], eval_cost_steps: float = 0.0, phases: tuple = (),
                 full_size: tuple[int, int] = (1, 1), agree: Callable[[list[float]], list[float]] = lambda v: v,
                 say: Callable[[str], None] = lambda text: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.minutes, self.deadline_s = minutes, minutes * 60.0
        self.active = minutes > 0
        self.t_start, self.clock = started_at, clock
        self.max_steps, self.measure_steps, self.eval_every = max_steps, measure_steps, eval_every
        self.warmup, self.agree, self.say = warmup, agree, say
        self.phases, self.full_size = tuple(tuple(p) for p in phases), tuple(full_size)
        self.per_step = f"ms per {full_size[0]}-pixel step" if self.phases else "ms/step"
        # the final evaluation gets a quarter more as margin: it is the longest single task and
        # nothing after it can absorb an overrun
        self.final_eval_ratio = 1.25 * final_eval_views
        self.reduced_final_ratio = 1.25  # the final evaluation with the periodic views only
        self.final_reduced = False  # the final evaluation's extra views do not fit: the periodic views
        self.eval_cost_steps = eval_cost_steps
        # kept free for saving, plots and a slower last evaluation
        self.reserve_s = 5.0 + 0.005 * self.deadline_s
        self.eval_s, self.evals_timed = 0.0, 0  # mean duration of the periodic evaluations, and their count
        self.last_eval_s = 0.0
        self.units, self.paused_s, self.size_before = 0.0, 0.0, None  # full-size steps done; seconds paused
        self.last_step_s = 0.0  # the latest step's duration: the guard looks one step ahead
        self.fitted = not self.active  # whether the total is final
        self.first_mark = self.warm_mark = self.decay_mark = None  # (step, units, time, paused_s)
        self.warm_refit_at = self.decay_at = 0
        self.mark_at = 2  # the step from which the first fit times the steps
        self.fit_at = self.mark_at + measure_steps  # the step after which the first fit is made
        self.decay_refits = 0
        self.remeasure_at: int | None = None

    # ------------------------------------------------------------------ what the loop reports

    @property
    def planned(self) -> bool:
        """Whether the total number of steps comes from the time limit yet (before the first
        fit it is the config's ``optim.steps``, a ceiling, not a plan)."""
        return not self.active or self.fitted or self.warm_mark is not None

    def elapsed(self) -> float:
        return self.clock() - self.t_start

    def step_done(self, size: tuple[int, int], seconds: float) -> None:
        """A step at ``size`` (H, W) took ``seconds``; one that changed the size (a compiled
        model compiles again) counts as a pause."""
        if self.size_before is not None and size != self.size_before:
            self.paused_s += seconds
        else:
            self.units += step_cost(size, self.full_size)
        self.size_before, self.last_step_s = size, seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the block is not training time."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.paused_s += self.clock() - t0

    def evaluated(self, seconds: float) -> None:
        """A periodic evaluation took ``seconds``: the plan uses the mean of all so far (one
        alone is a noisy figure on a shared machine)."""
        self.evals_timed += 1
        self.eval_s += (seconds - self.eval_s) / self.evals_timed
        self.last_eval_s = seconds

    def state(self) -> dict:
        """The clock, for a checkpoint, and whether the schedule was fitted to the time yet."""
        return {"elapsed_s": self.elapsed(), "eval_s": self.eval_s, "evals_timed": self.evals_timed,
                "planned": self.planned}

    def resume(self, state: dict, step: int, total_steps: int) -> None:
        """Go on from a checkpoint's clock: the time between the stop and the restart, and any
        steps made after the checkpoint, are not counted.  The steps are timed again from two
        after the restart (the machine may differ, and its first steps compile): to refit the
        decay, or, where the checkpoint came before the first fit (its ``total_steps`` the
        configured ceiling), to make that fit as a fresh run does."""
        self.t_start = self.clock() - float(state.get("elapsed_s", 0.0))
        self.eval_s = float(state.get("eval_s", 0.0))
        self.evals_timed = int(state.get("evals_timed", 1 if self.eval_s > 0 else 0))
        if not self.active:
            return
        # a checkpoint of before "planned" was kept: a total below the ceiling can only be a fitted one
        if state.get("planned", total_steps < self.max_steps):
            self.fitted, self.remeasure_at = True, step + 2
        else:
            self.mark_at = step + 2
            self.fit_at = self.mark_at + self.measure_steps

    # ------------------------------------------------------------------ the plan

    def wants_evaluation(self, step: int) -> bool:
        """Whether the first fit, due after this step, needs an evaluation timed first: not
        when the budget left is too short for it and the final one (estimated from the step
        time, which then stands in for the timing)."""
        if self.fitted or self.first_mark is None:
            return False
        if step < self.fit_at:
            self._fit_early_if_short(step)
        if step != self.fit_at:
            return False
        estimate = self.eval_cost_steps * self._first_rate()
        if estimate <= 0:
            return True
        ratio = min(self.final_eval_ratio, self.reduced_final_ratio)
        late = self.elapsed() + (1 + ratio) * estimate + self.reserve_s > self.deadline_s
        if self.agree([float(late)])[0] > 0:  # every rank skips it alike (the evaluation is collective)
            self.eval_s = estimate
            return False
        return True

    def final_views_fit(self) -> bool:
        """Whether the final evaluation keeps its extra test-time views: False when the fit
        found no room for them, or the time left no longer holds them (a slowdown); the
        loop then evaluates with the periodic views.  Says so once."""
        if not self.active or self.final_eval_ratio <= self.reduced_final_ratio:
            return True
        # a quarter of the reserve, where the guard keeps half: a run the guard stopped keeps its views
        late = self.elapsed() + self.final_eval_ratio * self.eval_s + self.reserve_s / 4 > self.deadline_s
        if self.agree([float(late)])[0] > 0 and not self.final_reduced:
            self.final_reduced = True
            self._say_reduced()
        return not self.final_reduced

    def plan(self, step: int, total_steps: int) -> int:
        """The total number of steps, after ``step`` steps."""
        if not self.active:
            return total_steps
        if step == self.remeasure_at:  # a resumed run: both decay refits again, over the steps left
            self.decay_mark, self.decay_refits, self.remeasure_at = self._mark(step), 0, None
            self.decay_at = step + max((total_steps - step) // 2, self.measure_steps)
        if self.decay_mark is not None and step == self.decay_at:
            total_steps = self._refit_since(self.decay_mark, step)
            self.decay_refits += 1
            self.decay_mark = self._mark(step) if self.decay_refits < 2 else None
            self.decay_at = step + (total_steps - step) // 2
        if self.fitted:
            return total_steps
        if step == self.mark_at:
            self.first_mark = self._mark(step)
        elif self.first_mark is not None and step == self.fit_at:
            sec_per_step = self._first_rate() - self.last_eval_s / max(self.units - self.first_mark[1], 1e-9)
            total_steps = self._fit(step, sec_per_step)
            self.warm_mark = self._mark(step)
            self.warm_refit_at = max(self.warmup(total_steps), step + 2 * self.measure_steps)
            self.say(f"time limit {self.minutes:g} min: {sec_per_step * 1000:.0f} {self.per_step}, "
                     f"eval {self.eval_s:.1f} s -> {total_steps} steps (warm-up {self.warmup(total_steps)})")
        elif self.warm_mark is not None and step == self.warm_refit_at:
            total_steps, self.fitted = self._refit_since(self.warm_mark, step), True
            self.decay_mark, self.decay_at = self._mark(step), step + (total_steps - step) // 2
        if total_steps <= step:
            total_steps, self.fitted = step, True
        return total_steps

    def out_of_time(self, step: int, total_steps: int) -> bool:
        """Slower than planned (a busy machine): stop after this step when the next one would
        leave less than the final evaluation and half the reserve, so that the final evaluation
        keeps its views (``final_views_fit``).  All ranks answer alike."""
        if not self.active or not (self.fitted or self.warm_mark is not None) or step >= total_steps:
            return False
        left_after_next = self.deadline_s - self.elapsed() - self.last_step_s
        late = left_after_next < self._final_ratio() * self.eval_s + self.reserve_s / 2
        if self.agree([float(late)])[0] <= 0:
            return False
        self.say(f"time limit reached at step {step}/{total_steps}: stopping before the schedule's end")
        return True

    # ------------------------------------------------------------------ helpers

    def _first_rate(self) -> float:
        """Seconds per full-size step since the first mark, counted with the pauses since
        (logging, checkpoints: their share per step; the loop's timing evaluation too, which
        the first fit takes out)."""
        _, units0, t0, _ = self.first_mark
        return (self.clock() - t0) / max(self.units - units0, 1e-9)

    def _fit_early_if_short(self, step: int) -> None:
        """Move the first fit to this step when timing the remaining measure steps would run
        past the deadline (a set-up that took most of a short
        budget: the first run on a dataset decodes it).  All ranks decide alike."""
        if step <= self.first_mark[0] or self.units <= self.first_mark[1]:
            return  # no full-size step timed since the mark (a size change is a pause): no rate yet
        # the evaluation's cost is not counted: its estimate from the step time can be far off
        # (a step's optimiser and augmentation weigh nothing in an evaluation), and the fit
        # that follows makes room for it
        late = self.elapsed() + (self.fit_at - step) * self._first_rate() + self.reserve_s > self.deadline_s
        if self.agree([float(late)])[0] > 0:
            self.fit_at = step
            self.say(f"time limit {self.minutes:g} min: {self.elapsed():.0f} s gone at step {step} "
                     f"(set-up included): the schedule is fitted now, after {step - self.first_mark[0]} timed step(s)")

    def _final_ratio(self) -> float:
        """The final evaluation's planned cost in periodic evaluations."""
        return self.reduced_final_ratio if self.final_reduced else self.final_eval_ratio

    def _say_reduced(self) -> None:
        self.say(f"time limit {self.minutes:g} min: the final evaluation's extra test-time views "
                 f"(~{self.final_eval_ratio / 1.25 * self.eval_s:.0f} s) do not fit; it uses the periodic views")

    def _mark(self, step: int) -> tuple[int, float, float, float]:
        return step, self.units, self.clock(), self.paused_s

    def _seconds_per_step_since(self, mark: tuple[int, float, float, float]) -> float:
        _, units0, t0, paused0 = mark
        return (self.clock() - t0 - (self.paused_s - paused0)) / max(self.units - units0, 1e-9)

    def _fit(self, step: int, sec_per_step: float) -> int:
        steps_cost = (lambda start, total: schedule_cost(start, total, self.phases, self.full_size)) \
            if self.phases else None
        if not self.final_reduced and self.final_eval_ratio > self.reduced_final_ratio:
            # not even with no more steps: plan for the periodic views, and the steps they leave room for
            late = self.elapsed() + self.final_eval_ratio * self.eval_s + self.reserve_s > self.deadline_s
            if self.agree([float(late)])[0] > 0:
                self.final_reduced = True
                self._say_reduced()
        ratio = self._final_ratio()
        total = fit_steps_to_time(
            budget_s=self.deadline_s, elapsed_s=self.elapsed(), step=step, sec_per_step=sec_per_step,
            eval_s=self.eval_s, final_eval_s=ratio * self.eval_s, eval_every=self.eval_every,
            reserve_s=self.reserve_s, max_steps=self.max_steps, steps_cost=steps_cost)
        return int(self.agree([float(total)])[0])  # the ranks agree on one total

    def _refit_since(self, mark: tuple[int, float, float, float], step: int) -> int:
        sec_per_step = self._seconds_per_step_since(mark)
        total = self._fit(step, sec_per_step)
        self.say(f"time limit: {sec_per_step * 1000:.0f} {self.per_step} over steps {mark[0]}-{step} -> {total} steps")
        return total
