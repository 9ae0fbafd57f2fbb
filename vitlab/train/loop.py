"""The training loop: ``train(cfg)`` = ``build`` (everything made once) + the step loop.

Each iteration: the lr of this step (a pure function of the step) -> one optimiser step
(``step.train_step``; one whose loss or gradients are not finite is not applied, and
``numerics.NonFinite`` stops the run or counts it) -> the time budget's plan
(``time_budget.TimeBudget``) -> every ``run.eval_every`` steps and at the end an
evaluation (``vitlab.eval.Evaluator``, the one `vitlab eval` runs) -> every
``run.log_every`` steps a metrics record -> every ``run.ckpt_every`` steps and at the end
an atomic, checksummed checkpoint (``checkpoint.py``) from which ``resume`` continues
bit-exactly (``state.py``), after a kill too.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable

import torch

from vitlab.analysis.cost import model_flops
from vitlab.analysis.utilization import matmul_peak, mfu
from vitlab.config import ConfigError, is_number, need, need_bool, need_output_folder
from vitlab.data.labelled import same_data
from vitlab.eval.features import tta_view_count
from vitlab.files import atomic_write_text, remove_temporaries
from vitlab.machine import Machine
from vitlab.weights.native import WEIGHTS_NAME

from . import checkpoint as ckpt
from .build import Setup, build, check_data
from .config import TrainConfig, to_dict
from .distributed import (Agreement, World, all_reduce_sum, barrier, broadcast_from_main, elastic_restart_count,
                          init_world, local_rank, shutdown)
from .diverged import DIVERGED_NAME
from .inputs import Spans, WaitTimed
from .metrics import MetricsWriter, Progress, plot_curves
from .numerics import NonFinite
from .schedules import input_size_at, lr_at, warmup_steps
from .memory import retain_freed_memory
from .resolve import run_memory_record, resolve_device, this_machine
from .state import (check_finished_run_unchanged, check_same_classes, check_same_run, check_same_split, final_model,
                    process_state, restore_state, set_process_state, set_rng_state, sharded, training_state)
from .step import StepResult, endless, running_statistics, train_step
from .time_budget import TimeBudget

log = logging.getLogger(__name__)


def clock() -> float:
    """The run's clock in seconds (``time.monotonic``): the time budget, the steps, evaluations
    and pauses, and the records' rates are read from it; tests drive a run with one of their own."""
    return time.monotonic()


def train(cfg: TrainConfig, resume: bool = False, verbose: bool = True, overwrite: bool = False,
          started_at: float | None = None) -> dict:
    """Train as ``cfg`` says; returns the summary (also written to ``run.out/summary.json``).

    The summary holds the final validation metrics, the path of the final weights
    (``vitlab.weights.load_model`` reads them; class names in ``classes.json`` beside
    them), the number of steps, wall time and throughput.

    ``resume`` continues from the newest intact checkpoint in ``run.out/checkpoints`` (a
    damaged newer one is set aside with a warning).  Without it, a folder holding an
    earlier run's checkpoints is refused, unless ``overwrite`` (then those checkpoints
    are deleted first).  A group that torchrun restarted after a failure
    (``--max-restarts``) always resumes.

    ``started_at``: the ``time.monotonic()`` at which a ``run.time_limit`` budget starts
    counting (default: now); the CLI passes its process's start, so that the budget is the
    command's whole wall time.
    """
    if not isinstance(cfg, TrainConfig):  # a recipe's name, say: its cfg.run failed as an AttributeError
        raise ConfigError(f"cfg={cfg!r:.80}: expected a TrainConfig (vitlab.configs.load_recipe('demo') gives "
                          f"one), got a {type(cfg).__name__}")
    check_resume_or_overwrite(resume, overwrite)  # before a process group is joined
    need_bool("verbose", verbose)
    need(started_at is None or is_number(started_at), "started_at", started_at,
         "expected None or a time.monotonic() reading")
    machine = this_machine()  # the host, read once for the run
    world = init_world(resolve_device(cfg.run.device, machine, local_rank()))  # the group joined here is ended here
    succeeded = False
    caller = process_state()
    try:
        # autograd on for the run: under a caller's no_grad or inference_mode its first backward failed;
        # and no autocast but the run's own (run.precision): a caller's bf16 autocast made an fp32 run
        # bf16 (the caller's modes come back as the blocks end)
        with torch.inference_mode(False), torch.enable_grad(), without_autocast(world.device):
            summary = _train(cfg, world, machine, resume, verbose, overwrite, started_at)
        succeeded = True
    finally:
        shutdown(world, wait_for_others=succeeded)
        set_process_state(caller)  # a library call leaves its caller's threads and random streams as it found them
    return summary


def without_autocast(device: torch.device) -> ExitStack:
    """A caller's autocast turned off, on the CPU and the run's device, for the blocks inside."""
    stack = ExitStack()
    for kind in dict.fromkeys(("cpu", device.type)):
        stack.enter_context(torch.autocast(device_type=kind, enabled=False))
    return stack


def check_resume_or_overwrite(resume: bool, overwrite: bool) -> None:
    """One of the two: with both, ``resume`` won and ``overwrite`` was dropped without a word,
    so a run meant to start afresh continued an old one.  Each True or False: a string is truthy,
    and overwrite="no" deleted the earlier run's checkpoints."""
    need_bool("resume", resume)
    need_bool("overwrite", overwrite)
    if resume and overwrite:
        raise ConfigError("resume=True and overwrite=True (--resume, --overwrite): one continues the run in "
                          "run.out, the other deletes its checkpoints and starts afresh; give one of them")


def resume_advice(cfg: TrainConfig) -> str:
    """What ``--resume`` of ``cfg``'s run goes on from, said as Ctrl-C ends it: its newest checkpoint, or
    step 0 where it wrote none (run.ckpt_every=0 saves the last step's alone)."""
    newest = ckpt.latest_checkpoint(Path(cfg.run.out) / "checkpoints")
    if newest is not None:
        return f"run it again with --resume to go on from its newest checkpoint, {newest}"
    every = cfg.run.ckpt_every
    return (f"no checkpoint of it was written (run.ckpt_every={every}{': the last step alone' if not every else ''}), "
            "so --resume would train it again from step 0")


def held_by_earlier_run(out: Path) -> str | None:
    """What a fresh run in ``out`` would lose of an earlier one: "checkpoints" (it would rotate them
    away and write over its weights), "weights" (a run whose checkpoints are gone: a finished vtab run's,
    removed once its weights were written, or removed by hand; run.ckpt_every=0 still writes the last), or None."""
    if ckpt.latest_checkpoint(out / "checkpoints") is not None:
        return "checkpoints"
    return "weights" if (out / WEIGHTS_NAME).exists() else None


def check_nothing_held(out: Path) -> None:
    """Refuse a fresh run (neither ``resume`` nor ``overwrite``) in a folder holding an earlier run's
    checkpoints or weights, which it would write over."""
    held = held_by_earlier_run(out)
    if held:
        options = "continue it with --resume, start" if held == "checkpoints" else "start"
        raise ConfigError(f"run.out={str(out)!r} holds the {held} of an earlier run; {options} afresh there with "
                          "--overwrite, or choose another --out")


def check_own_folder(cfg: TrainConfig) -> None:
    """Refuse to start afresh (``overwrite``) in a folder that holds a run of another recipe or data:
    the demo replaces its own folder on every run, and given a `train` run's folder as its --out it
    deleted that run's checkpoints and weights without a word."""
    out = Path(cfg.run.out)
    held = held_by_earlier_run(out)
    if held is None:
        return
    try:
        earlier = json.loads((out / "config.json").read_text())
        recipe, source = earlier.get("recipe"), earlier.get("data", {}).get("source")
    except (OSError, ValueError, AttributeError):  # no config.json, or not a run's
        recipe = source = None
    if recipe != cfg.recipe or not same_data(cfg.data.source, source):
        of = f"a {recipe!r} run on {source!r}" if isinstance(recipe, str) else "an earlier run"
        raise ConfigError(f"run.out={str(out)!r} holds the {held} of {of}; the {cfg.recipe} recipe on "
                          f"{cfg.data.source!r} starts afresh only in a new folder or one of its own: choose "
                          "another --out")


def _train(cfg: TrainConfig, world: World, machine: Machine, resume: bool, verbose: bool, overwrite: bool,
           started_at: float | None) -> dict:
    """The body of ``train``; returns with the model out of scope, so the process group can go."""
    t_start = clock() if started_at is None else min(started_at, clock())
    restarts = elastic_restart_count()
    if restarts:  # torchrun started the group again after a process died: continue, never start over
        resume, overwrite = True, False
    # each process looks at its own host's files: a refusal of one (its data missing there) is every process's,
    # which else waited for it in the resolution's first agreement
    with Agreement(world):
        check_data(cfg)  # an empty data folder is named as such, not as an output folder holding checkpoints
        # before the checkpoint folder is looked into and the process-wide memory setting below (build's
        # check_can_run repeats it for build's other callers)
        need_output_folder("run.out", cfg.run.out)
        out = Path(cfg.run.out)
        ckpt_dir = out / "checkpoints"
        held = held_by_earlier_run(out)
        if not resume and not overwrite:
            check_nothing_held(out)
        elif resume and held == "weights":  # there was nothing to continue: it trained from step 0 over the weights
            raise ConfigError(f"--resume: run.out={str(out)!r} holds the weights of an earlier run and no checkpoint "
                              "to continue it from (a finished run's were removed); start afresh there with "
                              "--overwrite, or choose another --out")
    # a resumed run's checkpoint is read first: its record of how the run was resolved goes into the build
    last_saved, state = resume_point(world, ckpt_dir, restarts) if resume else (None, None)
    if cfg.run.retain_freed_memory and world.device.type == "cpu":
        retain_freed_memory()  # process-wide, for the rest of the process: the run's own choice
    setup = build(cfg, world, machine, saved=state.get("resolved") if state else None)
    cfg = setup.cfg  # as resolved: the recipe's settings for this device, every "auto" stated
    torch.set_num_threads(setup.resolved.threads)  # the caller's come back when ``train`` returns
    set_rng_state(setup.rng)
    main = setup.world.is_main
    progress = Progress(enabled=verbose and main)
    for note in setup.resolved.notes:
        progress.message(note)
    progress.message(setup.resolved.line())
    if setup.fp8 is not None:
        progress.message(setup.fp8.line())
    if state is not None:  # before the run's folder is written: a refused resume wrote over its config and classes
        check_same_run(setup.cfg, state.get("config", {}))  # as resolved: the init's model, "auto"s decided
        check_finished_run_unchanged(setup.cfg, state.get("config", {}), int(state["step"]), int(state["total_steps"]))
        check_same_classes(setup.splits.classes, state.get("classes"))
        check_same_split(setup.splits.split_key, state.get("split_key"))
    # a resumed run's config.json states its settings once it has saved a step taken under them: a launch that
    # stopped before (a step not finite, --set optim.lr=1e9) left it claiming settings nothing the folder holds
    # was trained with
    start_output_folder(setup, out, afresh=held is not None and not resume, config=state is None)
    config_due = state is not None and main
    budget = time_budget(setup, t_start, progress)
    nonfinite = NonFinite(cfg.run.on_nonfinite, cfg.run.max_skipped_steps)

    step, total_steps, records, window_state = 0, cfg.optim.steps, [], None
    # the schedule's length, which the summary reports: ``total_steps`` too, unless the time limit ends the
    # run before the schedule's end (``total_steps`` is then the step it stopped at)
    planned = total_steps
    if state is not None:
        step, total_steps, records = restore_state(setup, state)
        planned = int(state.get("planned_steps", total_steps))
        window_state = state.get("window")
        nonfinite.load_state_dict(state.get("numerics"))
        budget.resume(state.get("clock", {}), step, total_steps)
        # before the time limit's first fit the total is the ceiling, optim.steps: the fit is made again
        of = f"/{total_steps}" if budget.planned else " (its schedule not fitted to the time limit yet: timing steps)"
        progress.message(f"resumed from {last_saved} at step {step}{of}, {budget.elapsed() / 60:.1f} min into the run")
        del state
    elif resume:
        progress.message(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
    writer = MetricsWriter(out, tensorboard=cfg.run.tensorboard, records=records) if main else None

    batches = WaitTimed(endless(setup.stream), setup.world.device, clock)  # times the steps' waits for their batches
    full_size_rate = StepRate(setup.world.device, tuple(setup.img_size), clock)  # the summary's MFU reads its rate
    window = Window(setup.world.device, batches, full_size_rate)
    window.load_state_dict(window_state, main)  # a checkpoint taken between two records: the steps since the first
    pending: list = []  # (step, result) since the last check: their flags are read in one go
    last_val: dict = {}
    phases = tuple(tuple(p) for p in cfg.data.progressive_sizes)
    setup.trained.train()
    while step < total_steps:
        lr = lr_at(step, base_lr=cfg.optim.lr, total_steps=total_steps,
                   warmup_steps=warmup_steps(cfg.optim, total_steps), decay=cfg.optim.decay, min_lr=cfg.optim.min_lr)
        size = input_size_at(step, total_steps, phases, setup.img_size)
        timed = full_size_rate.start(size)
        t_step = clock()
        result = train_step(setup, batches, lr, size)  # nothing read back: its numbers stay on the device
        step_s = clock() - t_step
        full_size_rate.stop(timed, result.seen)
        pending.append((step + 1, result))
        window.add(result, step_s)
        budget.step_done(size, step_s)
        step += 1

        if budget.wants_evaluation(step):  # the first fit plans with an evaluation's duration
            with budget.paused():
                nonfinite.check(setup, pending, last_saved)
                with window.paused():
                    last_val = evaluate(setup, budget)
        total_steps = planned = budget.plan(step, total_steps)
        if budget.out_of_time(step, total_steps):
            total_steps = step

        is_last = step >= total_steps
        with budget.paused():  # evaluations, logging, checkpoints: not training time
            do_eval = setup.evaluator is not None and (is_last or (cfg.run.eval_every and step % cfg.run.eval_every == 0))
            do_save = (cfg.run.ckpt_every and step % cfg.run.ckpt_every == 0) or is_last
            do_log = is_last or do_eval or step % cfg.run.log_every == 0
            if do_log or do_save:  # the steps' flags are read here: a bad one stops the run, or is counted
                nonfinite.check(setup, pending, last_saved)
            if do_eval:  # the last one with the final views, unless a short time limit has no room for them
                with window.paused():
                    last_val = evaluate(setup, budget, final=is_last and budget.final_views_fit())
            if do_log:
                record = (window.record(setup, step, lr, budget.elapsed()) | nonfinite.record(setup.scaler)
                          | (last_val if do_eval else {}))
                if writer is not None:
                    writer.log(record)
                if do_eval:
                    progress.message(f"step {step}: {validation_line(last_val)}")
            rate, shown_loss = window.shown(setup.world.size)
            eta = (total_steps - step) * cfg.optim.batch_size / rate if rate else 0.0
            progress.update(step, total_steps if budget.planned else None, shown_loss, rate, eta)
            if do_save:
                with window.paused():
                    state = training_state(setup, step, total_steps, writer.records if writer else [],
                                           budget.state(), nonfinite.state_dict(), window, planned)
                    last_saved = save_checkpoint(setup, state, ckpt_dir, step)
                    if config_due:
                        write_config(setup, out)
                        config_due = False
                    # under FSDP rank 0's is a gathered copy of the whole model and optimiser state: kept, it
                    # stayed beside the next steps and the final weights' copies (the memory estimate's rank 0)
                    del state

    if not last_val and setup.evaluator is not None:  # resumed a finished run: its summary still reports the metrics
        last_val = evaluate(setup, budget, final=True)
    if config_due:  # a finished run resumed at its end, which takes no step
        write_config(setup, out)
    progress.close()
    return finish(setup, step, planned, last_val, budget.elapsed(), writer, nonfinite, window.data_wait(),
                  full_size_rate, kept=steps_measured(out) if window.total_step_s == 0 else None)


# ----------------------------------------------------------------------------- the loop's helpers


def evaluate(setup: Setup, budget: TimeBudget, final: bool = False) -> dict:
    """The validation metrics as ``val_*`` (none without a validation split); the periodic
    evaluations' durations go to the time budget."""
    evaluator = setup.final_evaluator if final else setup.evaluator
    if evaluator is None:
        return {}
    t_eval = clock()
    # BatchNorm's running statistics move by every process's micro-batches together (distributed.SyncedBatchNorm),
    # alike on each process up to rounding; every process scores its share of the examples with rank 0's, which
    # the saved weights hold
    broadcast_from_main(running_statistics(setup.evaluated), setup.world)
    result = evaluator.run(setup.evaluated)
    if sharded(setup):  # a forward without backward leaves FSDP's root parameters gathered
        setup.model.reshard()
    if not final:
        budget.evaluated(clock() - t_eval)
    return {f"val_{k}": v for k, v in result.items() if k != "n"}


def validation_line(val: dict) -> str:
    """An evaluation's metrics (``evaluate``'s) in words: top-1 and top-5, or a multi-label set's
    precision@1 (the top-1 class is one of the image's labels), and the loss."""
    if "val_prec1" in val:
        return f"val prec@1 {val['val_prec1']:.4f} loss {val['val_loss']:.4f}"
    return f"val top-1 {val['val_top1']:.4f} top-5 {val['val_top5']:.4f} loss {val['val_loss']:.4f}"


def resume_point(world: World, ckpt_dir: Path, restarts: int) -> tuple[Path | None, dict | None]:
    """The newest intact checkpoint and its state, (None, None) for none.  Every process
    reads it; newer damaged ones (a failed checksum) are named in a warning and, once all
    have chosen, renamed to ``*.damaged`` by rank 0 so that they leave the rotation."""
    path, state, damaged = ckpt.load_latest_intact(ckpt_dir)
    if restarts and world.is_main:
        log.warning("torchrun restart %d: resuming from %s", restarts, path or "step 0 (no checkpoint yet)")
    if not damaged:
        return path, state
    if path is None:
        names = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise ckpt.CheckpointError(f"--resume: no intact checkpoint in {ckpt_dir} ({names}); start afresh with "
                                   "--overwrite")
    barrier(world)
    if world.is_main:
        for bad, why in damaged:
            aside = ckpt.set_aside(bad)
            log.warning("--resume: %s is damaged (%s), moved to %s; resuming from the previous checkpoint, %s",
                        bad, why, aside.name, path)
    return path, state


def save_checkpoint(setup: Setup, state: dict, ckpt_dir: Path, step: int) -> Path:
    """Rank 0 writes ``state``; every process learns whether it could, and all stop
    together with the same ``CheckpointError`` if it could not (a full disk)."""
    error = None
    if setup.world.is_main:
        try:
            ckpt.save_checkpoint(state, ckpt_dir, step, setup.cfg.run.keep_ckpts)
        except ckpt.CheckpointError as err:
            error = err
    failed = all_reduce_sum([1.0 if error is not None else 0.0], setup.world)[0]  # also the barrier after the write
    if error is not None:
        raise error
    if failed:
        raise ckpt.CheckpointError(f"rank 0 could not write the checkpoint of step {step} to {ckpt_dir} (its "
                                   "error says why); the earlier checkpoints are intact")
    return ckpt.checkpoint_path(ckpt_dir, step)


def write_config(setup: Setup, out: Path) -> None:
    """The run's config.json: its configuration, what its "auto" settings resolved to, and
    the peak memory estimated for it before it was built.  Like classes.json and summary.json it is
    replaced whole (``atomic_write``): a resumed run writes it again, and written in place, a full disk
    left a finished run's file cut short, the run taken for none (``finished_run``)."""
    records = {"resolved": setup.resolved.record()}
    if setup.memory is not None:  # with the measurement that chose a GPU's micro-batch, where there was one
        records["memory_estimate"] = run_memory_record(setup.resolved)
    atomic_write_text(out / "config.json", json.dumps(to_dict(setup.cfg) | records, indent=2))


# what a finished run leaves besides its config, class names and metrics (which a run writes anew as it starts)
EARLIER_RESULTS = ("checkpoints", "summary.json", WEIGHTS_NAME, "curves.png", "tensorboard")
# the files of a run's folder its rank 0 replaces whole (``atomic_write``): a write of one killed outright
# leaves its temporary file (.NAME.<hex>.tmp) beside them
RUN_RECORDS = ("config.json", "classes.json", "metrics.jsonl", "metrics.csv", "summary.json", WEIGHTS_NAME,
               DIVERGED_NAME)


def start_output_folder(setup: Setup, out: Path, afresh: bool, config: bool = True) -> None:
    """The run's folder with its config (unless not ``config``) and class names (rank 0); an earlier run's
    checkpoints and results removed when ``afresh`` (``--overwrite``), and the temporary files of writes of its
    checkpoints and records (``RUN_RECORDS``) that were killed removed in any case.  Left until the
    new run's end, an earlier run's summary and weights beside the new config.json passed for the new
    run's: an experiment interrupted in it reported the earlier run's numbers as its finished run
    (``finished_run``), and predict read the earlier weights with the new class names."""
    if setup.world.is_main and afresh:
        for name in EARLIER_RESULTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    if setup.world.is_main:
        for partial in ckpt.remove_partial_writes(out / "checkpoints"):
            log.warning("removed %s, left by a checkpoint write that was killed", partial)
        for partial in remove_temporaries(out, RUN_RECORDS):
            log.warning("removed %s, left by a write of the run's records that was killed", partial)
    barrier(setup.world)
    if setup.world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if config:
            write_config(setup, out)
        atomic_write_text(out / "classes.json", json.dumps(setup.splits.classes))


def time_budget(setup: Setup, t_start: float, progress: Progress) -> TimeBudget:
    run = setup.cfg.run
    return TimeBudget(
        run.time_limit, t_start, max_steps=setup.cfg.optim.steps, measure_steps=run.time_measure_steps,
        eval_every=run.eval_every,
        final_eval_views=tta_view_count(run.eval_flip, run.final_eval_shift, run.final_eval_diagonal)
        / tta_view_count(run.eval_flip),
        warmup=lambda total: warmup_steps(setup.cfg.optim, total), phases=setup.cfg.data.progressive_sizes,
        # a forward is about a third of a training step's work per image
        eval_cost_steps=(0 if setup.evaluator is None else len(setup.splits.val_labels))
        * tta_view_count(run.eval_flip) / (3 * setup.cfg.optim.batch_size),
        full_size=setup.img_size, agree=lambda values: [v / setup.world.size for v in all_reduce_sum(values, setup.world)],
        say=progress.message, clock=clock)


class StepRate:
    """Images per second of this process's steps at the full training size, each step timed
    from its start to its end on the clock that sees its work (``Spans``: on a GPU the device's
    stream), its wait for its batch included: the rate the summary's model-FLOPs utilisation
    reads.  Evaluations, logging and checkpoints fall between steps and are not timed.  Left out
    as the time budget leaves them out: this process's first two steps (allocation,
    compilation) and a step at another size than the one before (a compiled model compiles
    again); and the steps of a progressive-resizing phase below the full size, whose images
    cost fewer FLOPs."""

    def __init__(self, device: torch.device, full_size: tuple[int, int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spans, self.full_size = Spans(device, clock), full_size
        self.begun, self.size_before = 0, None  # steps begun in this process; the last one's size
        self.images, self.seconds = 0, 0.0

    def start(self, size: tuple[int, int]):
        """A step at ``size`` (H, W) begins: its start mark, or None when it is not timed."""
        timed = self.begun >= 2 and size == self.size_before == self.full_size
        self.begun, self.size_before = self.begun + 1, size
        return self.spans.mark() if timed else None

    def stop(self, start, images: int) -> None:
        """The step whose mark is ``start`` (None: untimed) is done, having taken ``images`` images."""
        if start is not None:
            self.spans.close(start)
            self.images += images

    def take(self) -> None:
        """Count the timed steps' seconds; on a GPU once the device has done them (``Spans.take``)."""
        self.seconds += self.spans.take()


class Window:
    """The training numbers since the last record, summed on the device (the record reads
    them), and those the progress line shows; ``batches``' waits give ``data_wait``, the
    share of the steps' time spent waiting for data; ``full_size_rate``'s steps are counted at each
    record, when the device has done them.  The rate (``img_per_s``) leaves out the time spent
    in ``paused`` blocks: the evaluations and checkpoints between the steps."""

    def __init__(self, device: torch.device, batches: WaitTimed | None = None,
                 full_size_rate: StepRate | None = None) -> None:
        self.device = device
        self.full_size_rate = full_size_rate
        self.rate, self.loss_shown, self.logged = 0.0, None, False  # no loss read yet: the progress line shows "-"
        self.grad_norm = torch.full((), float("nan"), device=device)
        self.batches = batches
        self.step_s = self.total_wait_s = self.total_step_s = 0.0
        self.reset()

    def reset(self) -> None:
        # [loss, correct, examples, steps] of the applied steps; a step left out adds nothing
        self.sums = torch.zeros(4, device=self.device)
        self.examples, self.t = 0, clock()  # every example the steps took (the rate)
        self.paused_s = 0.0  # of the time since ``t``, spent in ``paused`` blocks

    @contextmanager
    def paused(self):
        """Time spent in the block is not the steps': an evaluation or a checkpoint, begun once the
        steps' flags were read (the device has done the steps)."""
        t0 = clock()
        try:
            yield
        finally:
            self.paused_s += clock() - t0

    def state_dict(self, world: World) -> dict:
        """The applied steps' sums since the last record over all ranks, and the last gradient
        norm, for a checkpoint (a collective call; a read of the device: checkpoint steps only)."""
        sums, grad_norm = self.sums.tolist(), self.grad_norm.item()
        return {"sums": all_reduce_sum(sums, world), "grad_norm": grad_norm}

    def load_state_dict(self, state: dict | None, is_main: bool) -> None:
        """Go on with a checkpoint's sums (None: none saved), held by rank 0: the record adds
        the ranks' sums."""
        if state is not None:
            if is_main:
                self.sums = torch.tensor(state["sums"], dtype=self.sums.dtype, device=self.device)
            self.grad_norm = torch.full((), state["grad_norm"], device=self.device)

    def add(self, result: StepResult, step_s: float = 0.0) -> None:
        self.step_s += step_s
        applied = result.skipped == 0
        # no tensor made from a host number: on a GPU that copy would wait for the device
        self.sums += torch.where(applied, torch.stack([result.loss.float(), result.correct.float(),
                                                       applied * result.seen, applied.float()]), 0.0)
        self.grad_norm = torch.where(applied, result.grad_norm.float(), self.grad_norm)  # a skipped step's is NaN
        self.examples += result.seen

    def record(self, setup: Setup, step: int, lr: float, elapsed_s: float) -> dict:
        """The metrics record of this window over all ranks (a collective call; the read of the
        device's sums); starts the next."""
        dt = clock() - self.t - self.paused_s
        *sums, grad_norm = torch.cat([self.sums, self.grad_norm.view(1)]).tolist()
        waited = self.batches.take() if self.batches is not None else 0.0  # after the read: the steps are done
        if self.full_size_rate is not None:
            self.full_size_rate.take()
        loss, correct, seen, steps, examples, wait_s, step_s = all_reduce_sum(
            [*sums, float(self.examples), waited, self.step_s], setup.world)
        record = {
            "step": step, "epoch": round(step * setup.cfg.optim.batch_size / setup.splits.train_count(), 3),
            "lr": lr, "loss": loss / steps if steps else float("nan"),
            # masked patch prediction's regression of the pixels predicts nothing right or wrong: no top-1 (not 0)
            "train_top1": None if setup.cfg.model.mpp == "pixels" else correct / max(seen, 1), "grad_norm": grad_norm,
            "img_per_s": examples / max(dt, 1e-9), "elapsed_s": elapsed_s,
            "data_wait": round(wait_s / step_s, 4) if step_s else None,
        }
        self.total_wait_s, self.total_step_s = self.total_wait_s + wait_s, self.total_step_s + step_s
        self.step_s = 0.0
        self.rate, self.loss_shown, self.logged = record["img_per_s"], record["loss"], True
        self.reset()
        return record

    def data_wait(self) -> float | None:
        """The share of the recorded steps' time (all processes) spent waiting for batches."""
        return round(self.total_wait_s / self.total_step_s, 4) if self.total_step_s else None

    def shown(self, world_size: int) -> tuple[float, float | None]:
        """(images/setup, loss) for the progress line: the last record's; before the first one
        this process's rate and no loss yet (reading it would wait for the device)."""
        if not self.logged and self.examples:
            self.rate = self.examples * world_size / max(clock() - self.t - self.paused_s, 1e-9)
        return self.rate, self.loss_shown


# the summary's measurements of the steps themselves (``finish``'s data_wait, ``utilization_summary``'s)
STEP_MEASURES = ("data_wait", "train_flops_per_image", "step_images_per_s", "achieved_tflops", "peak_bf16_tflops", "mfu")


def steps_measured(out: Path) -> dict:
    """The ``STEP_MEASURES`` of the summary in ``out`` ({} for none): a finished run resumed at its end
    takes no step to measure, and its summary, written again, gave them as None."""
    try:
        earlier = json.loads((out / "summary.json").read_text())
        return {k: earlier[k] for k in STEP_MEASURES if k in earlier} if isinstance(earlier, dict) else {}
    except (OSError, ValueError):
        return {}


def finish(setup: Setup, step: int, planned_steps: int, last_val: dict, wall: float, writer, nonfinite: NonFinite,
           data_wait: float | None = None, full_size_rate: StepRate | None = None, kept: dict | None = None) -> dict:
    """Save the final weights and the summary (rank 0); every rank returns the summary, on a
    GPU with the steps' model-FLOPs utilisation (``utilization``), measured once the weights
    are saved.  ``planned_steps``: the schedule's length (more than ``step`` where the time
    limit stopped the run before it).  ``kept``: the earlier summary's ``STEP_MEASURES`` of a run
    that took no step here (a finished run resumed), which it keeps (None: it measured its own)."""
    from vitlab.weights import save_model

    cfg, out = setup.cfg, Path(setup.cfg.run.out)
    model = final_model(setup)
    records = writer.records if writer else []
    train_rows = [r for r in records if "img_per_s" in r]
    skipped = setup.splits.skipped  # decoded sets; a streamed training set's, as its readers (all ranks) met them
    if setup.splits.source is not None:
        skipped += setup.stream.unread_everywhere().images
    summary = {
        "recipe": cfg.recipe,
        "model": getattr(setup.model.cfg, "name", None) or cfg.model.name,
        "steps": step,
        "planned_steps": planned_steps,
        # a multi-label validation set's precision@1 (``vitlab.eval.Evaluator``) under its own name: no top-1 or top-5
        **({"val_prec1": last_val["val_prec1"]} if "val_prec1" in last_val
           else {"val_top1": last_val.get("val_top1"), "val_top5": last_val.get("val_top5")}),
        "val_loss": last_val.get("val_loss"),
        **{k: last_val[k] for k in VIEW_SCORES if k in last_val},
        "train_loss": train_rows[-1]["loss"] if train_rows else None,
        "train_examples": int(setup.splits.train_count()),
        "val_examples": int(len(setup.splits.val_labels)) if setup.splits.val_labels is not None else 0,
        # which images they are (their names and file sizes): eval and fewshot of the run refuse a split of its
        # data changed since, whose held-out part can hold images it trained on, where counts alone pass
        "split_key": setup.splits.split_key,
        "skipped_images": skipped,
        "wall_s": round(wall, 2),
        "images_per_s": round(step * cfg.optim.batch_size / wall, 1),
        "data_wait": data_wait,  # the share of the steps' wall time spent waiting for their batches
        "world_size": setup.world.size,
        **nonfinite.record(setup.scaler),
        "weights": None,
    }
    if setup.world.is_main:
        # the loss goes with the weights (their metadata): a copy of the file alone is scored as the run trained it
        weights = save_model(model, out / WEIGHTS_NAME, loss=cfg.optim.loss)
        # absolute, as the config records the data and the init: as typed, they named the files from the folder
        # the command ran in, and from another an experiment took its finished run for none (read back:
        # ``read_summary``)
        summary["weights"] = str(Path(weights).absolute())
        summary["classes"] = str((out / "classes.json").absolute())
    if full_size_rate is not None and kept is None:
        summary |= utilization(setup, full_size_rate)
    summary |= kept or {}
    if setup.world.is_main:
        if writer is not None:
            writer.close()
            plot = plot_curves(records, out / "curves.png")
            summary["curves"] = str(Path(plot).absolute()) if plot else None
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


# the summary's scores of test-time views (``Evaluator``'s, a multi-label set's under prec1)
VIEW_SCORES = tuple(f"val_{score}_{views}" for score in ("top1", "prec1") for views in ("flip", "single", "views"))


SCORE_NAMES = {"top1": "top-1", "prec1": "prec@1"}  # a validation score's field (val_<it>) and its name in words


def val_score(summary: dict) -> tuple[str, float | None]:
    """("top1", its top-1), or a multi-label validation set's ("prec1", its precision@1): what a run's
    summary reports of its validation set (None without one)."""
    return ("prec1", summary["val_prec1"]) if "val_prec1" in summary else ("top1", summary.get("val_top1"))


# a summary's fields that name a file of its run's folder
SUMMARY_FILES = ("weights", "classes", "curves")


def read_summary(out: str | Path) -> dict:
    """The summary a run wrote into its folder ``out``, its files (``SUMMARY_FILES``) those in ``out``, absolute:
    a summary written before they were recorded absolute named them from the folder its command ran in, and
    a run's folder may have been moved since; either way, read from another folder they named no file."""
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_FILES:
        if isinstance(summary.get(key), str):
            summary[key] = str((out / Path(summary[key]).name).absolute())
    return summary


def utilization(setup: Setup, rate: StepRate) -> dict:
    """The run's fields of ``utilization_summary``: the training FLOPs of one full-size image (of
    the patches it keeps, with ``patch_dropout``), the timed steps' images per second per device
    (all processes' images over all their seconds) and, on a GPU, the device's bf16 matmul peak
    measured now.  A collective call."""
    images, seconds = all_reduce_sum([float(rate.images), rate.seconds], setup.world)
    device = setup.world.device
    return utilization_summary(device, 3 * model_flops(setup.model.cfg, setup.img_size, training=True),
                               images / seconds if seconds > 0 else None, lambda: device_peak(device))


def device_peak(device: torch.device) -> float | None:
    """The device's bf16 matmul peak in FLOP/s (``matmul_peak``: 8192^3, the best of ten
    repeats of a tenth of a second each); None when the device has no memory left for it,
    which leaves the run's summary without MFU rather than failing a finished run."""
    try:
        return matmul_peak(device, torch.bfloat16, size=8192, warmup=3, repeats=10, min_seconds=0.1).best
    except torch.OutOfMemoryError:
        log.warning("no memory left on %s to measure its matmul peak: the summary gives no MFU", device)
        return None


def utilization_summary(device: torch.device, train_flops_per_image: float, images_per_s: float | None,
                        measure_peak: Callable[[], float | None]) -> dict:
    """The summary's model-FLOPs utilisation on a GPU: ``train_flops_per_image`` (3x the
    forward, multiply-add = 2), the steps' ``step_images_per_s`` per device, the
    ``achieved_tflops`` they amount to, the bf16 matmul peak ``measure_peak()`` gives
    (``peak_bf16_tflops``; not measured without a rate to divide) and ``mfu`` = achieved / peak,
    None where a figure is missing.  Nothing on a CPU: measuring its peak well would hold the
    cores the run has just used for a while."""
    if device.type != "cuda":
        return {}
    peak = measure_peak() if images_per_s else None
    achieved = train_flops_per_image * images_per_s if images_per_s else None
    shown = lambda value: float(f"{value:.4g}")  # noqa: E731  four figures: a small model's MFU is a fraction of 1%
    return {
        "train_flops_per_image": int(train_flops_per_image),
        "step_images_per_s": round(images_per_s, 1) if images_per_s else None,
        "achieved_tflops": shown(achieved / 1e12) if achieved else None,
        "peak_bf16_tflops": shown(peak / 1e12) if peak else None,
        "mfu": shown(mfu(train_flops_per_image, images_per_s, peak)) if achieved and peak else None,
    }
