"""The time budget as a unit: a fake clock, observed step times in, a plan out."""
from vitlab.train.schedules import fit_steps_to_time
from vitlab.train.time_budget import TimeBudget


class FakeRun:
    """Steps of given durations on a fake clock, as the loop reports them."""

    def __init__(self, minutes=1.0, measure_steps=3, eval_every=0, final_eval_views=1.0):
        self.now, self.messages = 0.0, []
        self.budget = TimeBudget(minutes, 0.0, max_steps=1_000_000, measure_steps=measure_steps,
                                 eval_every=eval_every, final_eval_views=final_eval_views,
                                 warmup=lambda total: total // 10, full_size=(8, 8), say=self.messages.append,
                                 clock=lambda: self.now)
        self.step, self.total = 0, 1_000_000

    def run(self, seconds: float, until: int, eval_s: float = 0.0, pause_s: float = 0.0) -> None:
        while self.step < until and self.step < self.total:
            self.now += seconds
            self.budget.step_done((8, 8), seconds)
            self.step += 1
            if self.budget.wants_evaluation(self.step):
                with self.budget.paused():
                    self.now += eval_s
                    self.budget.evaluated(eval_s)
            self.total = self.budget.plan(self.step, self.total)
            if self.budget.out_of_time(self.step, self.total):
                self.total = self.step
            with self.budget.paused():
                self.now += pause_s


def expected_total(step, elapsed, sec_per_step, eval_s=0.0, final_eval_s=None):
    return fit_steps_to_time(budget_s=60.0, elapsed_s=elapsed, step=step, sec_per_step=sec_per_step, eval_s=eval_s,
                             final_eval_s=1.25 * eval_s if final_eval_s is None else final_eval_s, eval_every=0,
                             reserve_s=5.0 + 0.005 * 60.0, max_steps=1_000_000)


def test_no_limit_plans_nothing():
    run = FakeRun(minutes=0.0)
    run.run(0.1, until=50)
    assert run.total == 1_000_000 and run.messages == []


def test_the_first_fit_uses_the_steps_after_the_first_two_and_one_evaluation():
    run = FakeRun()
    run.run(5.0, until=2)  # the first steps compile: not measured
    run.run(0.1, until=5, eval_s=2.0)
    # 3 steps of 0.1 s measured; the evaluation (2 s) is the fit's, not a step's
    assert run.budget.eval_s == 2.0 and run.budget.evals_timed == 1
    assert run.total == expected_total(5, 10.3 + 2.0, 0.1, eval_s=2.0)
    assert run.total == 5 + int((60 - 12.3 - 2.5 - 5.3) // 0.1)
    assert "0.1" not in run.messages[0] and "100 ms/step" in run.messages[0]


def test_refits_follow_a_change_of_speed_and_exclude_pauses():
    run = FakeRun()
    run.run(0.1, until=5)
    first = run.total
    warm_refit_at = max(first // 10, 5 + 2 * 3)
    run.run(0.2, until=warm_refit_at, pause_s=0.5)  # twice as slow, and paused after every step
    elapsed = run.now - 0.5  # the plan came before the last step's pause
    assert run.total == expected_total(warm_refit_at, elapsed, 0.2) < first  # 0.2 s: the pauses are left out
    assert any(f"over steps 5-{warm_refit_at} ->" in m for m in run.messages)
    # two refits in the decay, each over the steps since the one before
    run.run(0.2, until=10**9)
    stretches = [m.split("over steps ")[1].split(" ")[0] for m in run.messages if "over steps" in m]
    assert len(stretches) == 3 and stretches[1].split("-")[0] == str(warm_refit_at)
    assert run.step == run.total  # ran to the end of its plan


def test_the_guard_stops_a_run_that_slowed_down_after_the_last_refit():
    run = FakeRun()
    run.run(0.1, until=5)
    while run.step < run.total and len([m for m in run.messages if "over steps" in m]) < 3:
        run.run(0.1, until=run.step + 1)
    planned = run.total
    run.run(1.0, until=10**9)  # ten times slower after the last refit
    assert run.step < planned and any("time limit reached" in m for m in run.messages)
    # stopped with the final evaluation's share and half the reserve still left
    assert run.now <= 60.0 - (5.0 + 0.005 * 60.0) / 2 + 1.0


def test_a_run_the_guard_stopped_keeps_its_final_views():
    """The guard stops a step early enough for the final evaluation's extra views: it fired,
    and then the views were dropped as not fitting, on a CPU shared for part of a run."""
    run = FakeRun(final_eval_views=5.0)
    run.run(0.1, until=5, eval_s=1.0)
    while run.step < run.total and len([m for m in run.messages if "over steps" in m]) < 3:
        run.run(0.1, until=run.step + 1)
    planned = run.total
    run.run(0.3, until=10**9)  # three times slower after the last refit
    assert run.step < planned and any("time limit reached" in m for m in run.messages)
    assert run.budget.final_views_fit() and not any("do not fit" in m for m in run.messages)
    assert run.now + 5 * 1.0 <= 60.0  # the final evaluation with its views ends by the deadline


def test_a_resumed_budget_keeps_the_clock_and_times_again():
    run = FakeRun()
    run.run(0.1, until=30)
    state = run.budget.state()
    resumed = FakeRun()
    resumed.now = 1000.0  # another process, another clock
    resumed.budget.resume(state, step=30, total_steps=run.total)
    resumed.step, resumed.total = 30, run.total
    assert abs(resumed.budget.elapsed() - state["elapsed_s"]) < 1e-9
    resumed.run(0.1, until=resumed.step + 2 + 1)
    assert resumed.budget.decay_mark is not None and resumed.budget.decay_mark[0] == 32  # timed from 2 after


def test_a_budget_resumed_from_before_its_first_fit_makes_it():
    # a checkpoint of step 4, before the fit after step 5, holds the ceiling as the total: the resumed
    # budget took it as fitted and kept it. It times its steps from two after the restart and fits then,
    # the time before the checkpoint counted; so does a checkpoint of before the record ("planned")
    run = FakeRun()
    run.run(0.125, until=4)
    state = run.budget.state()
    assert state["planned"] is False
    older = {k: v for k, v in state.items() if k != "planned"}
    for clock in (state, older):
        resumed = FakeRun()
        resumed.now = 1000.0  # another process, another clock
        resumed.budget.resume(clock, step=4, total_steps=1_000_000)
        resumed.step = 4
        assert not resumed.budget.planned
        resumed.run(4.0, until=6)  # the restart's first steps compile: not measured
        resumed.run(0.125, until=9)
        assert resumed.total == expected_total(9, 0.5 + 8.0 + 0.375, 0.125) < 1_000_000
        assert resumed.budget.planned and "125 ms/step" in resumed.messages[0]
    # an older checkpoint of after the fit: its total, below the ceiling, is the fitted one
    resumed = FakeRun()
    resumed.budget.resume(older, step=30, total_steps=500)
    assert resumed.budget.planned and resumed.budget.remeasure_at == 32


def run_whole_command(minutes, setup_s, step_s, eval_s, final_views, eval_cost_steps, save_s=1.0):
    """A whole time-limited command on the fake clock, as the loop drives the budget: set-up
    (imports, data) before the first step, the steps with the evaluation the first fit may
    time, the final evaluation (``final_views`` periodic evaluations' worth with its extra
    test-time views, one without), then saving.  Returns (end time, budget, views used)."""
    now = [setup_s]
    budget = TimeBudget(minutes, 0.0, max_steps=1_000_000, measure_steps=10, eval_every=0,
                        final_eval_views=final_views, warmup=lambda total: total // 20,
                        eval_cost_steps=eval_cost_steps, full_size=(8, 8), clock=lambda: now[0])
    step, total = 0, 1_000_000
    while step < total:
        now[0] += step_s
        budget.step_done((8, 8), step_s)
        step += 1
        if budget.wants_evaluation(step):
            with budget.paused():
                now[0] += eval_s
            budget.evaluated(eval_s)
        total = budget.plan(step, total)
        if budget.out_of_time(step, total):
            total = step
    full_views = getattr(budget, "final_views_fit", lambda: True)()
    now[0] += eval_s * (final_views if full_views else 1.0) + save_s
    return now[0], budget, full_views, step


def test_a_short_budget_ends_by_its_deadline():
    """`--time-limit 0.4` on CIFAR-10 (issue 43): 8 s of set-up, 100 ms steps, a 2-view
    evaluation of 3 s, a final one of 10 views (5x): timing an evaluation and running the
    10-view one do not fit in 24 s; the command still ends by the deadline, with the
    periodic views at the end."""
    end, budget, full_views, steps = run_whole_command(0.4, setup_s=8.0, step_s=0.1, eval_s=3.0, final_views=5.0,
                                                       eval_cost_steps=5000 * 2 / (3 * 128))
    assert end <= 24.0 and not full_views
    assert steps > 12  # the time the 10 views would have taken went to training steps
    # with more set-up there is no room to time an evaluation either: the estimate stands in
    end, budget, full_views, _ = run_whole_command(0.4, setup_s=14.0, step_s=0.1, eval_s=3.0, final_views=5.0,
                                                   eval_cost_steps=5000 * 2 / (3 * 128))
    assert end <= 24.0 and not full_views and budget.evals_timed == 0


def test_a_budget_with_room_keeps_the_final_views_and_uses_its_time():
    end, budget, full_views, _ = run_whole_command(2.0, setup_s=8.0, step_s=0.1, eval_s=3.0, final_views=5.0,
                                                   eval_cost_steps=5000 * 2 / (3 * 128))
    assert full_views and budget.evals_timed == 1
    assert 105.0 <= end <= 120.0  # the reserve and the final evaluation's margin are what is left


def test_without_an_estimate_the_evaluation_is_timed_as_before():
    _, budget, _, _ = run_whole_command(0.4, setup_s=8.0, step_s=0.1, eval_s=3.0, final_views=1.0,
                                        eval_cost_steps=0.0)
    assert budget.evals_timed == 1


def test_a_set_up_that_took_most_of_the_budget_shortens_the_timing():
    """The first run on a dataset decodes it (issue 43: 18 s of a 24 s budget): the ten timed
    steps and the final evaluation no longer fit, so the schedule is fitted after fewer
    timed steps; past the budget only by what the set-up left too short for three steps."""
    args = dict(step_s=1.0, eval_s=2.0, final_views=5.0, eval_cost_steps=2.0)
    end, budget, _, steps = run_whole_command(0.4, setup_s=14.0, **args)
    assert budget.fit_at < 12 and steps < 12
    assert end <= 24.0
    end, budget, _, steps = run_whole_command(0.4, setup_s=20.0, **args)
    assert budget.fit_at == 3 and steps == 3  # one timed step, and the guard stops there
    assert end == 20.0 + 3 * 1.0 + 2.0 + 1.0  # before: 20 + 12 timed steps + the evaluation
    # with room, the ten steps are timed as before
    _, budget, _, _ = run_whole_command(2.0, setup_s=14.0, **args)
    assert budget.fit_at == 12


def test_no_fit_before_a_full_size_step_was_timed():
    """Progressive resizing: a step that changes the size is a pause (it compiles again), so a short run
    (``--steps 3`` under the recipe's time limit) may reach the early-fit check with no step timed since
    the mark. The rate is unknown then, not a division by nothing: no fit, and no figure said."""
    now, messages = [0.0], []
    budget = TimeBudget(30.0, 0.0, max_steps=3, measure_steps=10, eval_every=2000, final_eval_views=5.0,
                        warmup=lambda total: 0, eval_cost_steps=2.0, phases=((24, 0.5),), full_size=(32, 32),
                        say=messages.append, clock=lambda: now[0])
    total = 3
    for step, size in ((1, (24, 24)), (2, (24, 24)), (3, (32, 32))):
        now[0] += 1.0
        budget.step_done(size, 1.0)
        assert not budget.wants_evaluation(step)
        total = budget.plan(step, total)
    assert total == 3 and messages == [] and budget.eval_s == 0.0
    # the next full-size step is timed, and the early fit may use it
    now[0] += 1.0
    budget.step_done((32, 32), 1.0)
    assert budget._first_rate() == 2.0  # two seconds since the mark (the pause included), one full-size step
