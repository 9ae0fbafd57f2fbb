"""Choosing the learning rate as the paper does (Appendix B.1.1), then retraining: `vitlab sweep`'s protocol.

    cfg = with_changes(load_recipe("paper_finetune:dataset=cifar10"), {
        "model.init": "ViT-B_16.npz", "data.source": "cifar10.tar.gz", "run.out": "runs/sweep"})
    report = run_sweep(cfg)   # also in runs/sweep/sweep.json

1. For every learning rate of the grid (``grid``, default the config's ``optim.lr_grid``,
   Table 4's {0.001, 0.003, 0.01, 0.03} in ``paper_finetune``) train ``cfg`` on the rest of
   the training set into ``run.out/lr_<rate>`` and measure top-1 on a held-out part
   (class-stratified, seeded): ``holdout``, by default the config's ``data.val_split``, which
   for ``paper_finetune`` is the appendix's share per dataset (10% Pets and Flowers, 2% CIFAR,
   1% ImageNet); 10% for a config without one.  ``data.val_data`` plays no part here.  A rate
   whose run diverges (stops on a loss or gradients that are not finite, ``run.on_nonfinite``)
   loses, as any rate worse than the best: its score is None and the others go on.  Its folder
   keeps why (``diverged.DIVERGED_NAME``, with the run's config), so that ``resume`` counts it lost again
   rather than training it to the same end; a run of another config there is trained.
2. Retrain with the best learning rate (of rates tied, the lowest) on the full training set into ``run.out/final``
   (``final_val_split`` still holds that many examples out for a final number; the default
   holds out none; the config's ``data.val_data`` scores the final run, and only it).  A final run
   that diverges stops the sweep (``NonFiniteError``), its record kept as a rate's is: ``resume``
   stops on it again rather than training it to the same end.
   ``resume`` refuses, before any run, runs of the folder trained with other settings than ``cfg``'s
   (``SETTINGS_NAME`` records them): a finished rate's run was read back as this sweep's and compared
   with rates trained on the new settings.
3. The report: every grid point's held-out top-1, the chosen rate and the final run's
   summary (its weights' path included), also written to ``run.out/sweep.json``.
Any config sweeps; one with ``model.init`` is a fine-tuning sweep.

``run.time_limit`` (``--time-limit``) is each run's own budget, the final run's too: the sweep takes
about (rates + 1) x the limit.  Per run is the fair reading for comparing rates: every rate is scored
after the same training time, and a budget shared across the sweep would give the rates run last
whatever the earlier ones left.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Sequence

from vitlab.config import ConfigError, is_int, is_number, need, need_bool
from vitlab.files import atomic_write, remove_temporaries

from .build import check_can_run
from .config import TrainConfig, check_lr_grid
from .distributed import check_one_process
from .diverged import DIVERGED_NAME, finished_unless_diverged, unless_diverged
from .loop import SCORE_NAMES, check_nothing_held, check_resume_or_overwrite, held_by_earlier_run, train, val_score
from .metrics import Progress
from .numerics import NonFiniteError
from .overrides import field_value, with_changes
from .state import training_fields

log = logging.getLogger(__name__)

__all__ = ["run_sweep", "sweep_plan", "best_lr", "DEFAULT_HOLDOUT"]

DEFAULT_HOLDOUT = 0.1
# beside the runs' folders: what every run of the sweep trains with, which a later resume compares
SETTINGS_NAME = "settings.json"


def sweep_holdout(explicit: float | None, recipe_split: float | int) -> float | int:
    """What the grid is compared on: ``explicit`` (``--holdout``), else the recipe's validation split, else 10%.
    None held out leaves nothing to compare (0 failed after the first rate's run, on its missing score)."""
    if explicit == 0:
        raise ConfigError("--holdout 0: the grid is compared on a held-out part of the training set; give a count "
                          "(500) or a fraction (0.1)")
    # refused as data.val_split, a field the command line had not named
    if explicit is not None and not (0 < explicit < 1 or (explicit >= 1 and float(explicit).is_integer())):
        raise ConfigError(f"--holdout {explicit:g}: give a count (500) or a fraction in (0, 1) (0.1)")
    return count_or_fraction(explicit if explicit is not None else (recipe_split or DEFAULT_HOLDOUT))


def resolve_val_split(value: float | None) -> float | int:
    """The final run's ``data.val_split``: ``value`` (``--val-split``) if given, else 0 (none held out)."""
    return 0 if value is None else count_or_fraction(value)


def count_or_fraction(value: float | int) -> float | int:
    """A split as ``data.val_split`` takes it: a whole number of 1 or more as a count (an int), else as given."""
    return int(value) if float(value).is_integer() and value >= 1 else value


def sweep_plan(cfg: TrainConfig, grid: Sequence[float] = (), holdout: float | None = None,
               final_val_split: float | None = 0) -> tuple[tuple[float, ...], list[TrainConfig], TrainConfig,
                                                            float | int]:
    """(the grid, one config per learning rate of it, the final run's config, the hold-out the grid
    is compared on): what ``run_sweep`` trains, every config built and checked, nothing run."""
    if not isinstance(cfg, TrainConfig):  # a recipe's name, say: its cfg.model failed as an AttributeError
        raise ConfigError(f"cfg={cfg!r:.80}: expected a TrainConfig (vitlab.configs.load_recipe('demo') gives "
                          f"one), got a {type(cfg).__name__}")
    if cfg.model.mpp is not None:  # the first rate's run trained, then the sweep ended on its missing score
        raise ConfigError(f"model.mpp={cfg.model.mpp!r}: a sweep compares its rates by their held-out top-1, and "
                          "masked patch prediction trains no classifier to score; sweep the fine-tune of its weights "
                          "(--init) instead")
    grid = tuple(grid) if isinstance(grid, (list, tuple)) else grid
    check_lr_grid(grid, "grid")
    grid = tuple(float(lr) for lr in grid) or tuple(cfg.optim.lr_grid)
    if not grid:
        raise ConfigError("optim.lr_grid=(): the recipe has no learning-rate grid; pass --grid 0.001,0.003,...")
    need(holdout is None or is_number(holdout), "holdout", holdout, "expected a count (500) or a fraction (0.1)")
    need(final_val_split is None or is_number(final_val_split), "final_val_split", final_val_split,
         "expected a count (500), a fraction (0.1) or 0 for none")
    holdout = sweep_holdout(holdout, cfg.data.val_split)
    base_out = Path(cfg.run.out)
    # the grid is compared on its hold-out of the training set; a data.val_data set scores the final run only
    runs = [with_changes(cfg, {"optim.lr": lr, "data.val_split": holdout, "data.val_data": None,
                               "run.out": str(base_out / f"lr_{lr:g}")})
            for lr in grid]
    # the final retrain: the full training set, unless final_val_split holds some out (not the recipe's split)
    final = with_changes(cfg, {"run.out": str(base_out / "final"),
                               "data.val_split": resolve_val_split(final_val_split)})
    return grid, runs, final, holdout


def check_counts_fit(runs: Sequence[TrainConfig], final_cfg: TrainConfig) -> None:
    """Refuse a hold-out count (``--holdout``, ``--val-split``) that leaves none of the data's
    examples to train on, before any run: the final run's was found once every rate of the grid had
    trained, and either was named as data.val_split."""
    from .inputs import count_images

    for cfg, flag in ((runs[0], "--holdout"), (final_cfg, "--val-split")):
        split, data = cfg.data.val_split, cfg.data
        if not is_int(split) or split < 1:
            continue
        total = count_images(data.source, data.cache_dir)
        pool = min(total, data.train_examples) if data.train_examples else total
        if split >= pool:
            raise ConfigError(f"{flag} {split}: takes {split} of the {pool} examples; it must leave some to train on "
                              f"(1 to {pool - 1}, or a fraction in (0, 1))")


def check_final_lr(final_cfg: TrainConfig, best: float) -> None:
    """Refuse to ``--resume`` a final run made at another learning rate than the grid's best (a grid
    or hold-out changed since): the learning rate may change on resume, so its finished run was
    read back and reported as the retrain at the best rate."""
    out = Path(final_cfg.run.out)
    if held_by_earlier_run(out) is None:
        return
    try:
        lr = json.loads((out / "config.json").read_text())["optim"]["lr"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record of its rate: train's own checks decide
    if f"{lr:g}" != f"{best:g}":
        raise ConfigError(f"--resume: {str(out)!r} holds the final run at lr {lr:g}, but the grid's best is now "
                          f"{best:g}; move that folder away to retrain it, or choose another --out")


def trained_settings(cfg: TrainConfig) -> dict:
    """What every run of the sweep of ``cfg`` trains with beyond its rate, its data's split and what
    ``train --resume`` holds fixed itself (``state.RESUME_INVARIANTS``): the model's other fields, the
    augmentation, the optimiser and its schedule, the arithmetic, and the init as it is now (``file_key``:
    weights written again at its path).  ``train --resume`` takes these as changed on purpose, and a
    finished run, resumed at its end, is trained no further under them."""
    from vitlab.eval.features import file_key

    # its rate is the folder's; a time limit fits the schedule to it again, so steps is only its ceiling
    fields = [name for name in training_fields(cfg) if name not in ("optim.lr", "optim.lr_grid", "optim.steps")]
    values = {name: field_value(cfg, name) for name in fields}
    values["model.init"] = file_key(cfg.model.init) if cfg.model.init else None
    return json.loads(json.dumps(values))  # as the file holds them: tuples as lists


def check_same_settings(base_out: Path, runs: Sequence[TrainConfig], settings: dict, resume: bool) -> None:
    """With ``resume``, refuse a folder whose runs were trained with other ``settings``
    (``trained_settings``) than this sweep's, as its ``SETTINGS_NAME`` records them: a changed
    clipping, schedule or augmentation was accepted, a finished rate's run read back as trained with it
    (its config.json rewritten to say so) and compared with rates that were."""
    held = [r for r in runs if held_by_earlier_run(Path(r.run.out)) or (Path(r.run.out) / DIVERGED_NAME).exists()]
    record = base_out / SETTINGS_NAME
    if not resume or not held or not record.is_file():  # a sweep of an earlier version recorded none
        return
    try:
        before = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    changed = [f"{k}={settings[k]!r} (its runs: {before[k]!r})" for k in settings
               if isinstance(before, dict) and k in before and before[k] != settings[k]]
    if changed:
        raise ConfigError(f"--resume: the runs in {str(base_out)!r} were trained with other settings: "
                          f"{', '.join(changed)}; resume with the same ones, or train again with --overwrite or "
                          "into another --out")


def best_lr(grid: Sequence[float], scores: dict[str, float | None]) -> float:
    """The rate of ``grid`` whose score (``scores``, by rate as ``f"{lr:g}"``) is highest, of rates
    scoring alike the lowest (the choice is the grid's, whatever its order, and the lower rate is the
    further from diverging on the final run); a rate scored None (its run diverged) loses.  Raises
    ``NonFiniteError`` when every rate diverged."""
    scored = [lr for lr in grid if scores.get(f"{lr:g}") is not None]
    if not scored:
        raise NonFiniteError(f"every learning rate of the grid diverged ({', '.join(f'{lr:g}' for lr in grid)}): "
                             "their runs' loss or gradients were not finite, so none can be chosen; try lower rates")
    return max(scored, key=lambda lr: (scores[f"{lr:g}"], -lr))


def final_run(cfg: TrainConfig, resume: bool, overwrite: bool, verbose: bool, say: Callable[[str], object]) -> dict:
    """The summary of the final run of ``cfg`` (at the chosen rate); ``NonFiniteError`` naming it where it
    diverges, or where, resumed, its run of this config diverged before: kept on record as a rate's is
    (``unless_diverged``), it is not trained again (it was, to the same end)."""
    lr = f"{cfg.optim.lr:g}"
    return finished_unless_diverged(cfg, lambda: train(cfg, resume=resume, overwrite=overwrite, verbose=verbose),
                                    resume, say, f"final run at lr {lr}",
                                    f"the final run at lr {lr} diverged, so the sweep has no result")


def run_sweep(cfg: TrainConfig, grid: Sequence[float] = (), holdout: float | None = None,
              final_val_split: float | None = 0, resume: bool = False, overwrite: bool = False,
              verbose: bool = True, say: Callable[[str], object] | None = None) -> dict:
    """The sweep of the module docstring: ``cfg`` at every rate of ``grid`` (default its
    ``optim.lr_grid``) compared on ``holdout`` (default its ``data.val_split``, else 10%), then the
    final run at the best rate, holding ``final_val_split`` out (default none).

    Returns the report, also written to ``run.out/sweep.json``: ``holdout``, ``holdout_top1``
    ({rate: top-1}; a multi-label set's ``holdout_prec1``, its precision@1), ``best_lr``, ``diverged`` and ``final``
    (the final run's summary).  A rate whose run stops on a loss or gradients that are not finite
    (``run.on_nonfinite``) loses: its top-1 is None, ``diverged`` holds its error, and the other
    rates go on; ``NonFiniteError`` if every rate diverges.  Of rates that score alike, the
    lowest is chosen (``best_lr``).  ``resume``/``overwrite`` are ``train``'s, for every run;
    without either, a folder of any run holding an earlier run is refused before the first run
    starts, and with ``resume`` a final run made at another rate than the best is refused and a rate
    whose run of the same config diverged is counted lost again, untrained (``diverged_before``); a final
    run that diverges (now, or resumed, before) is ``NonFiniteError``.
    ``verbose``: the runs' progress; ``say``: called with a line per grid point as it is scored
    (default: on stderr when ``verbose``).  One process runs the sweep: a launch of several is refused
    (``distributed.check_one_process``); each run trains on one.
    """
    check_one_process("sweep")
    check_resume_or_overwrite(resume, overwrite)
    need_bool("verbose", verbose)
    need(say is None or callable(say), "say", say, "expected None or a function of one line of text")
    grid, runs, final_cfg, holdout = sweep_plan(cfg, grid, holdout, final_val_split)
    say = say or Progress(enabled=verbose).message
    for r in runs + [final_cfg]:  # every run is checked before the first one starts
        check_can_run(r)
    check_counts_fit(runs, final_cfg)
    if not resume and not overwrite:  # refused by the run it was in, after the runs before it had trained
        for r in runs + [final_cfg]:
            check_nothing_held(Path(r.run.out))
    base_out, settings = Path(final_cfg.run.out).parent, trained_settings(final_cfg)
    check_same_settings(base_out, runs + [final_cfg], settings, resume)
    for partial in remove_temporaries(base_out, ("sweep.json", SETTINGS_NAME)):
        log.warning("removed %s, left by a write of the sweep's records that was killed", partial)
    base_out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings, indent=2).encode()  # what a later resume compares, before the first run
    atomic_write(base_out / SETTINGS_NAME, lambda f: f.write(text))

    scores, diverged, score = {}, {}, "top1"
    for r in runs:
        lr = f"{r.optim.lr:g}"
        # a rate that diverges loses (the sweep stopped on it, the other rates unrun)
        summary, error = unless_diverged(r, lambda: train(r, resume=resume, overwrite=overwrite, verbose=verbose),
                                         resume, say, f"lr {lr}")
        if summary is None:
            scores[lr], diverged[lr] = None, error
            continue
        score, scores[lr] = val_score(summary)  # a multi-label set's precision@1, under its own name
        say(f"lr {lr}: held-out {SCORE_NAMES[score]} {scores[lr]:.4f}")
    best = best_lr(grid, scores)
    if resume:
        check_final_lr(final_cfg, best)
    final = final_run(with_changes(final_cfg, {"optim.lr": best}), resume, overwrite, verbose, say)
    report = {"holdout": holdout, f"holdout_{score}": scores, "best_lr": best, "diverged": diverged, "final": final}
    if final.get("weights") is not None:
        # beside the runs' folders, in the folder the command was given; written beside its place, then
        # renamed: written in place, a failure (a full disk) left an earlier sweep's report truncated
        text = json.dumps(report, indent=2).encode()
        atomic_write(Path(final_cfg.run.out).parent / "sweep.json", lambda f: f.write(text))
    return report

