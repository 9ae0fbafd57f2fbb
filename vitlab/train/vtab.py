"""The VTAB-1k protocol (paper Sec. 4.2, Appendix B.1.1): fine-tune on each task, choose the
learning rate on the fixed 200 validation examples (each task's own by default; one for all tasks, by
their mean, is the paper's), fine-tune again on all 1000, score on test.

    cfg = with_changes(load_recipe("vtab1k"), {"model.init": "ViT-B_16.npz", "run.out": "runs/vtab"})
    report = run_vtab(cfg, find_tasks("vtab/"), "runs/vtab")   # also in runs/vtab/vtab.json

For each task (``vitlab.eval.vtab``: its folders, its fixed splits, the group means):

1. fine-tune on ``train[:800]`` with every learning rate of the grid (default the config's
   ``optim.lr_grid``) and score each on ``train[800:1000]`` (a rate whose run diverges loses);
2. fine-tune on all 1000 with the best one (of rates tied, the lowest; ``select="per-task"``), or with the one whose
   mean over the tasks' validation sets is best (``select="shared"``: the paper used one
   setting for all tasks, chosen so);
3. score the final model on the task's test set.

Every run is ``cfg`` with the task's data, the learning rate and its own folder under
``out``, without the random flip or crop that changes its task's labels (``vitlab.eval.vtab.task_augment``:
BiT's Supplementary F, whose pre-processing the paper follows).  The batch is accumulated over
``accum_steps`` micro-batches, by default (``"auto"``) the fewest that fit in the memory available, by the run's memory estimate
(``resolve``), decided once for all the runs.  The protocol trains, so it lives in ``train`` (above ``eval``, which
holds what does not train: docs/layout.md).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from vitlab.config import ConfigError, is_int, need, need_bool
from vitlab.data.memory import load_in_memory
from vitlab.data.sources import source_key
from vitlab.eval.evaluator import Evaluator
from vitlab.eval.vtab import Task, TaskSplits, split_tasks, summarize, task_augment
from vitlab.files import atomic_write, remove_temporaries
from vitlab.weights import load_model

from .build import check_can_run
from .config import TrainConfig, check_lr_grid, to_dict
from .distributed import check_one_process, local_rank, local_world
from .diverged import finished_unless_diverged, unless_diverged
from .legacy import recorded_section
from .loop import held_by_earlier_run, read_summary, train
from .metrics import Progress
from .numerics import NonFiniteError
from .overrides import field_value, with_changes
from .resolve import precision_rule, resolve, resolve_device, resolved_threads, this_machine
from .state import RESUME_INVARIANTS
from .sweep import best_lr

__all__ = ["run_vtab", "evaluate_on", "SELECTIONS"]

log = logging.getLogger(__name__)

SELECTIONS = ("per-task", "shared")
# what ``run_vtab`` sets in every run's config, whatever ``cfg`` holds (the rate only when there is a grid)
PER_RUN_FIELDS = {
    "optim.lr": "each run's rate is one of the grid's (--grid; one rate: --grid 0.01)",
    "model.init": "every run starts from --init",
    "data.source": "each run trains on a view of its task (--tasks)",
    "data.train_examples": "each task's examples are --examples",
    "data.val_split": "each task's examples are cut 4:1 (--examples)",
    "run.out": "each run's folder is under --out",
}


def evaluate_on(weights: str, folder: Path, cfg: TrainConfig, device: torch.device | str,
                precision: str) -> tuple[float, int, int]:
    """(top-1, images, images left out as unreadable) of the weights on an ImageFolder view, at the
    resolution they were trained at, in the protocol's resolved ``precision``."""
    model = load_model(weights).to(device).eval()
    data = load_in_memory(folder, image_size=model.cfg.img_size, cache_dir=cfg.data.cache_dir,
                          workers=cfg.data.decode_workers)
    result = Evaluator(data.images, data.labels, batch_size=cfg.run.eval_batch_size, device=device,
                       precision=precision).run(model)
    return float(result["top1"]), int(result["n"]), data.skipped.images


@dataclass(frozen=True)
class Runs:
    """How every run of the protocol trains and is scored: ``cfg`` with the run's data and
    learning rate, into its folder under ``out``, scored on ``device`` in ``precision``."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    precision: str
    resume: bool = False   # a run that finished (its summary.json) is read back, one that stopped goes on
    verbose: bool = True

    def config(self, task: Task, source: Path, lr: float, folder: str) -> TrainConfig:
        """``cfg`` trained on ``source`` at ``lr`` into ``out/folder``, without the flips or crops that change
        ``task``'s labels (``task_augment``: a flipped dSprites image was trained on its unflipped location)."""
        return with_changes(self.cfg, {**task_augment(task.name), "data.source": str(source), "optim.lr": lr,
                                       "run.out": str(self.out / folder)})

    def fine_tune(self, run_cfg: TrainConfig) -> dict:
        """The summary of ``run_cfg`` (``config``) trained; with ``resume``, a run in its folder that
        finished is read back and one that stopped goes on from its newest checkpoint
        (``run.ckpt_every``), as ``train``'s resume does (it was started afresh, its checkpoints deleted)."""
        folder = Path(run_cfg.run.out)
        if self.resume and (folder / "summary.json").is_file():  # made with these settings: ``check_earlier_runs``
            return read_summary(folder)  # its weights scored, from whatever folder it was made in
        check_can_run(run_cfg)
        # a run not begun is started as such: resumed, each one said that it had no checkpoint to resume from
        stopped = self.resume and held_by_earlier_run(folder) == "checkpoints"
        summary = train(run_cfg, resume=stopped, overwrite=not stopped, verbose=self.verbose)
        # a finished run is read back from its summary and weights: its checkpoints (the optimiser's state
        # beside the weights) served only a stopped run's --resume, and over every task's runs they are
        # the protocol's largest use of disk
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        return summary

    def score(self, weights: str, folder: Path) -> tuple[float, int, int]:
        return evaluate_on(weights, folder, self.cfg, self.device, self.precision)


# what each task's runs in ``out`` were made with, read by a later ``--resume``
SETTINGS_NAME = "settings.json"


def task_settings(cfg: TrainConfig, task: Task, examples: int, split_seed: int) -> dict:
    """What a task's finished runs depend on, beyond the learning rate in their folder's name: the
    fields ``train --resume`` holds fixed, the steps, the init as it is now (``file_key``),
    the split and the task's folder and images.  Its data views are rewritten from these on every invocation,
    so a run made with others would be scored on images it may have trained on."""
    from vitlab.eval.features import file_key

    cfg = with_changes(cfg, task_augment(task.name))  # as the task's runs train
    # and how they trained: a finished run is read back whole, so a change to the schedule, the optimiser, the
    # augmentation or the precision (--set optim.weight_decay=0.1) was reported as these runs' without a word
    trained = [f"{section}.{name}" for section in ("model", "augment", "optim") for name in to_dict(cfg)[section]
               if f"{section}.{name}" not in ("model.init", "optim.lr", "optim.lr_grid")]
    fields = [n for n in RESUME_INVARIANTS if n != "data.source"] + trained + [
        "data.progressive_sizes", "run.precision", "run.loss_scale"]
    values = {name: field_value(cfg, name) for name in dict.fromkeys(fields)}
    # --examples and --split-seed cut train/; a task's own train800/ and val200/ are trained as given whatever
    # they are (``split_task``): its runs, refused a resume with another --examples, were the runs it would make
    if task.train800 is None or task.val200 is None:
        values.update({"examples": examples, "split_seed": split_seed})
    values.update({"model.init": file_key(cfg.model.init) if cfg.model.init else None,
                   "task folder": str(Path(task.folder).resolve()),
                   # its images as they are now (each one's path, size and time): the split is drawn from them, so
                   # images added to train/ re-cut it under runs made on the earlier cut
                   "task images": "-".join(source_key(p) for p in (task.train, task.train800, task.val200, task.test)
                                           if p is not None)})
    return json.loads(json.dumps(values))  # as the file holds them: tuples as lists


def run_precision(folder: Path) -> str | None:
    """The precision the run in ``folder`` trained in, as its config.json recorded it resolved; None
    where it recorded none."""
    try:
        recorded = json.loads((folder / "config.json").read_text())
        return (recorded.get("resolved") or {}).get("precision") or recorded_section(recorded, "run").get("precision")
    except (OSError, ValueError, AttributeError):
        return None


def check_earlier_runs(out: Path, settings: Mapping[str, dict], resume: bool, overwrite: bool) -> dict:
    """Refuse what would lose finished runs or present stale ones as this invocation's: running
    the tasks again over their finished runs, or runs that stopped and kept checkpoints, without
    ``overwrite`` (every run was trained again, the earlier ones written over without a word), or
    ``resume`` with other settings than the runs were made with (their summaries were read back as
    if made with these).  Returns the record of
    every task's settings to write (``SETTINGS_NAME``) once the runs are about to start."""
    if resume and overwrite:
        raise ConfigError("resume=True and overwrite=True (--resume, --overwrite): one keeps the finished runs, "
                          "the other trains them again; give one of them")
    finished = [p.parent for name in settings for p in sorted((out / name).glob("*/summary.json"))]
    if finished and not resume and not overwrite:
        raise ConfigError(f"--out={str(out)!r} holds {len(finished)} finished run(s) of these tasks "
                          f"({finished[0].relative_to(out)}, ...); keep them with --resume, train them again with "
                          "--overwrite, or choose another --out")
    # and runs that stopped before their end: started afresh, their checkpoints were deleted without a word
    stopped = [p for name in settings for p in sorted((out / name).glob("*/checkpoints"))
               if p.parent not in finished and held_by_earlier_run(p.parent) == "checkpoints"]
    if stopped and not resume and not overwrite:
        raise ConfigError(f"--out={str(out)!r} holds {len(stopped)} run(s) of these tasks that stopped before their "
                          f"end ({stopped[0].parent.relative_to(out)}, ...); continue them with --resume, start them "
                          "afresh with --overwrite, or choose another --out")
    record = out / SETTINGS_NAME
    try:
        earlier = json.loads(record.read_text()) if record.is_file() else {}
    except (OSError, ValueError):
        earlier = {}
    for name, now in settings.items() if resume else ():
        before = dict(earlier.get(name) or {})
        if before.get("run.precision") == "auto":  # a record of before it was resolved: the runs' own say
            kept = [run for run in finished + [p.parent for p in stopped] if run.parent == out / name]
            used = [p for p in map(run_precision, kept) if p not in (None, "auto")]
            before["run.precision"] = next((p for p in used if p != now.get("run.precision")), now.get("run.precision"))
        changed = [f"{k}={now[k]!r} (its runs: {before[k]!r})" for k in now if k in before and before[k] != now[k]]
        if changed:
            raise ConfigError(f"--resume: the runs of {name} in {out} were made with other settings: "
                              f"{', '.join(changed)}; resume with the same ones, or train again with --overwrite "
                              "or into another --out")
    return {**earlier, **settings}


def sweep_scores(runs: Runs, task: Task, views: TaskSplits, grid: Sequence[float], say) -> dict[str, float | None]:
    """{lr: top-1 on the task's validation examples} of a run on its sweep split per learning
    rate, None for a run that diverged (it loses); {} for a grid of one (one learning rate needs
    no choosing).  ``NonFiniteError`` if every rate diverged on the task.  Resumed, a rate whose run of
    the same config diverged is counted lost again, untrained (``diverged.diverged_before``)."""
    scores: dict[str, float | None] = {}
    for lr in grid if len(grid) > 1 else ():
        run_cfg = runs.config(task, views.sweep_train, lr, f"{task.name}/lr_{lr:g}")
        # a rate that diverges loses (it stopped the whole protocol)
        summary, _ = unless_diverged(run_cfg, lambda: runs.fine_tune(run_cfg), runs.resume, say,
                                     f"{task.name}: lr {lr:g}")
        if summary is None:
            scores[f"{lr:g}"] = None
            continue
        scores[f"{lr:g}"], _, _ = runs.score(summary["weights"], views.sweep_val)
        say(f"{task.name}: lr {lr:g}: top-1 {scores[f'{lr:g}']:.4f} on its {views.counts['val200']} validation "
            "examples")
    if scores and all(v is None for v in scores.values()):
        raise NonFiniteError(f"{task.name}: every learning rate of the grid diverged ({', '.join(scores)}): their "
                             "runs' loss or gradients were not finite, so none can be chosen; try lower rates")
    return scores


def chosen_lrs(grid: Sequence[float], val: Mapping[str, Mapping[str, float | None]], select: str) -> dict[str, float]:
    """The learning rate of each task's final run: the only one of a grid of one, else the best
    on its validation examples (``per-task``) or on their mean over the tasks (``shared``); of
    rates tied, the lowest (``sweep.best_lr``).  A rate that diverged (None) loses: ``shared``,
    one that diverged on any task."""
    if len(grid) == 1:
        return {name: grid[0] for name in val}
    if select == "shared":
        sums = {f"{lr:g}": None if any(v[f"{lr:g}"] is None for v in val.values())
                else sum(v[f"{lr:g}"] for v in val.values()) for lr in grid}
        if all(v is None for v in sums.values()):
            raise NonFiniteError(f"select='shared': every learning rate of the grid diverged on some task "
                                 f"({', '.join(sums)}), so none can be shared; try lower rates, or select='per-task'")
        shared = best_lr(grid, sums)
        return {name: shared for name in val}
    return {name: best_lr(grid, scores) for name, scores in val.items()}


def final_result(runs: Runs, task: Task, views: TaskSplits, lr: float, val: dict[str, float], say) -> dict:
    """One task's final run on all its training examples at ``lr``, scored on its test set;
    ``NonFiniteError`` naming the task where it diverges, or where, resumed, its run of this config diverged
    before: kept on record as a rate's is (``unless_diverged``), it is not trained again (it was, to the same end)."""
    run_cfg = runs.config(task, views.train, lr, f"{task.name}/final_lr_{lr:g}")
    final = finished_unless_diverged(run_cfg, lambda: runs.fine_tune(run_cfg), runs.resume, say,
                                     f"{task.name}: final run at lr {lr:g}",
                                     f"{task.name}: the final run at lr {lr:g} diverged, so the task has no test score")
    top1, n, unread = runs.score(final["weights"], views.test)
    skipped = final.get("skipped_images", 0) + unread  # left out as unreadable by its final run and its test set
    say(f"{task.name}: lr {lr:g}: test top-1 {top1:.4f} on {n} images ({views.test_split})"
        + (f"; {skipped} unreadable image(s) left out" if skipped else ""))
    return {"group": task.group, "lr": lr, "val_top1": val, "test_top1": top1, "test_examples": n,
            "test_split": views.test_split, "skipped_images": skipped, "train_examples": views.counts["train1000"],
            "val_examples": views.counts["val200"], "train_split": views.train_split,
            "classes": len(views.classes), "weights": final["weights"],
            "augment": {"crop": run_cfg.augment.crop, "flip": run_cfg.augment.flip}}


def run_vtab(cfg: TrainConfig, tasks: Sequence[Task], out: str | os.PathLike, examples: int = 1000,
             split_seed: int = 0, grid: Sequence[float] = (), select: str = "per-task",
             accum_steps: int | str = "auto", resume: bool = False, verbose: bool = True,
             overwrite: bool = False) -> dict:
    """The protocol over ``tasks`` (see the module docstring), every run ``cfg``'s, into ``out``.

    Returns the report, also written to ``out/vtab.json``: ``protocol`` (the settings),
    ``tasks`` (per task: its group, the validation top-1 of each learning rate, the one
    chosen, the test top-1 and its images, the crop and flip its runs trained with) and
    ``summarize``'s group means and mean.
    ``resume``: the runs that finished in ``out`` are read back, not run again, and a run that
    stopped goes on from its newest checkpoint (every ``run.ckpt_every`` steps; refused if they
    were made with other settings), and a rate whose run of the same config diverged is counted lost
    again, untrained (``diverged.diverged_before``), a final run so stops the protocol again, untrained (as one
    that diverges does, ``NonFiniteError``); ``overwrite``: they are trained again.  Without either, a
    folder holding finished or stopped runs of ``tasks`` is refused.  ``verbose``: a line per run on stderr,
    and the training runs' progress.
    """
    check_one_process("vtab")
    if not isinstance(cfg, TrainConfig):  # a recipe's name, say: its cfg.recipe failed as an AttributeError
        raise ConfigError(f"cfg={cfg!r:.80}: expected a TrainConfig (vitlab.configs.load_recipe('vtab1k') gives "
                          f"one), got a {type(cfg).__name__}")
    if select not in SELECTIONS:
        raise ConfigError(f"select={select!r}: expected one of {', '.join(SELECTIONS)}")
    # the runs trained on the subset, and the scoring, on the task's views of every class, ended on a label
    # beyond the head ("class index 2 is beyond the model's 2 classes") after the first run had trained
    need(not cfg.data.class_subset, "data.class_subset", cfg.data.class_subset,
         "a VTAB task is trained and scored on all of its classes; for fewer, make a task folder of those classes")
    # before any folder is written: no tasks ended in an IndexError, a folder's path in an AttributeError
    need(isinstance(tasks, Sequence) and bool(tasks) and all(isinstance(t, Task) for t in tasks), "tasks",
         tasks, "expected one or more vitlab.eval.vtab.Task, as find_tasks gives them")
    need(is_int(examples), "examples", examples, "expected an integer (1000: VTAB-1k)")
    need(is_int(split_seed), "split_seed", split_seed, "expected an integer")
    # a string grid ended in float's "could not convert string to float: '.'", and resume="no" read the finished
    # runs back (it was taken as true), both once the tasks' views were written
    grid = tuple(grid) if isinstance(grid, (list, tuple)) else grid
    check_lr_grid(grid, "grid")
    for name, value in (("resume", resume), ("overwrite", overwrite), ("verbose", verbose)):
        need_bool(name, value)
    out = Path(out)
    # every run trains on the whole of its view: the recipe's own 800/200 of 1000 (vtab1k's train_examples and
    # val_split) held a further 200 out of the views, and the final run trained on 800 of the 1000 it reported
    cfg = with_changes(cfg, {"optim.accum_steps": accum_steps, "data.train_examples": 0, "data.val_split": 0})
    machine = this_machine()
    world = local_world(resolve_device(cfg.run.device, machine, local_rank()))
    # "auto" decided first, as resolve decides it, so that the settings record states the arithmetic the runs
    # trained and scored in: recorded as "auto", a --resume where it now resolved otherwise (a calibration
    # stored since) trained and scored the tasks left in another one than the finished ones
    if cfg.run.precision == "auto":
        cfg = with_changes(cfg, {"run.precision": precision_rule(world.device, machine)})
    # before the task's data views are written again: the finished runs were scored on the earlier ones
    record = check_earlier_runs(out, {t.name: task_settings(cfg, t, examples, split_seed) for t in tasks},
                                resume, overwrite)
    splits = split_tasks(tasks, out, examples, split_seed)  # every task's folders, before any run
    grid = tuple(float(lr) for lr in grid) or tuple(cfg.optim.lr_grid) or (cfg.optim.lr,)
    check_lr_grid(grid, "grid")
    # decided once for every run of the protocol, on the first task's sweep split: the device,
    # the precision, the init's model and resolution, the micro-batch that fits (or a refusal)
    check_can_run(with_changes(cfg, {"data.source": "digits"}))  # the weights and the batch, before any run
    resolved = resolve(with_changes(cfg, {"data.source": str(splits[tasks[0].name].sweep_train)}), world, machine)
    cfg, device, precision, accum = resolved.config, world.device, resolved.precision, resolved.accum_steps
    runs, say = Runs(cfg, out, device, precision, resume, verbose), Progress(enabled=verbose).message
    for partial in remove_temporaries(out, (SETTINGS_NAME, "vtab.json")):  # as a run clears its records' (loop)
        log.warning("removed %s, left by a write of the protocol's records that was killed", partial)
    settings = json.dumps(record, indent=2).encode()  # what a later --resume compares: whole or as it was
    atomic_write(out / SETTINGS_NAME, lambda f: f.write(settings))
    say(f"vtab: {len(tasks)} tasks, lr grid {', '.join(f'{lr:g}' for lr in grid)} ({select}), "
        f"{cfg.optim.steps} steps at batch {cfg.optim.batch_size} ({accum} micro-batches of "
        f"{cfg.optim.batch_size // accum}), {examples} examples per task")
    with resolved_threads(resolved):  # the views are scored in the runs' threads (each run sets its own too)
        val = {task.name: sweep_scores(runs, task, splits[task.name], grid, say) for task in tasks}
        lrs = chosen_lrs(grid, val, select)
        results = {task.name: final_result(runs, task, splits[task.name], lrs[task.name], val[task.name], say)
                   for task in tasks}
    report = {"protocol": {"recipe": cfg.recipe, "init": cfg.model.init, "grid": list(grid), "select": select,
                           "steps": cfg.optim.steps, "batch_size": cfg.optim.batch_size, "accum_steps": accum,
                           "img_size": cfg.model.img_size, "examples": examples, "split_seed": split_seed},
              "tasks": results, **summarize(results)}
    out.mkdir(parents=True, exist_ok=True)
    # written beside its place, then renamed: in place, a failure (a full disk) left an earlier report truncated
    text = json.dumps(report, indent=2).encode()
    atomic_write(out / "vtab.json", lambda f: f.write(text))
    return report
