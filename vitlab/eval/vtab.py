"""VTAB-1k as the paper reports it (Sec. 4.2, Appendix B.1.1; Zhai et al. 2019): the tasks,
their three groups, each task's fixed splits, and the group means and the mean over tasks.

The benchmark: 19 tasks of 1000 training examples each, in three groups.  Settings are
chosen on a fixed split of each task's 1000 examples, 800 to train and 200 to validate on
(``train800`` / ``val200``); the final run trains on all 1000 and is scored on the task's
test set.  The paper uses one setting for all tasks (Appendix B.1.1: lr 0.01 and 2500 steps,
chosen from two rates and two schedules by the highest VTAB score on the 200-example
validation sets), which ``select="shared"`` reproduces over a grid of rates; the default,
``"per-task"``, gives each task the rate best on its own 200, which is not the paper's
protocol.  What is reported is the accuracy of each task, the mean of each group and the
mean over the 19 tasks, and the selection that chose the rates (``format_table``).
``vitlab.train.vtab.run_vtab`` runs it (`vitlab vtab`); this module holds what does not train.

A task is a folder named after the task (``TASK_GROUPS``; the usual spellings and the
paper's, Table 9's ``CIFAR-100``, ``dSpr-Loc``, ``sNORB-Azim``, ..., in any case and with any
punctuation, are accepted), holding ImageFolder trees::

    TASK/train/<class>/<image>   the training images (the first --examples, 1000, are used)
    TASK/test/<class>/<image>    the test images (optional)
  or
    TASK/train800/, TASK/val200/ VTAB-1k's own two splits, as exported, and TASK/test/ (trained as given,
                                 whatever --examples: each result's ``train_split`` says which)

From ``train/`` the split is fixed: the images in the ImageFolder order (classes, then
paths, sorted), permuted by numpy's PCG64 generator seeded with ``seed``, then
``train[:800]`` trains the sweep, ``train[800:1000]`` validates it, ``train[:1000]``
trains the final run (4:1 for any ``examples``).  Without ``test/`` the task's test set
is the rest of its training set, ``train[1000:]``, which the results state.  Every task's
folders are checked (``find_tasks``, ``split_tasks``) before any task is trained, and what
is missing is named for all of them at once.

The splits are written as ImageFolder views (links to the task's images) that hold every
class folder of the task, so that their labels agree; a class the 200 validation examples
miss is an empty folder there by design, marked so (``EMPTY_CLASS_MARK``: reading the
view warns of no empty class).
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from vitlab.config import ConfigError
from vitlab.data.sources import EMPTY_CLASS_MARK, DataError, ImageFolderIndex, scan_image_folder

# the 19 tasks (the names VTAB's code gives them) and the other spellings accepted for each: the
# paper's (Table 9: CIFAR-100, dSpr-Loc, sNORB-Azim, Clevr-Count, ...) and tensorflow_datasets'
TASK_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    # natural
    "caltech101": ("natural", ()),
    "cifar100": ("natural", ("cifar",)),
    "dtd": ("natural", ()),
    "oxford_flowers102": ("natural", ("flowers102", "flowers")),
    "oxford_iiit_pet": ("natural", ("pets", "oxford_pets", "oxford_iiit_pets")),
    "sun397": ("natural", ()),
    "svhn": ("natural", ("svhn_cropped",)),
    # specialized
    "patch_camelyon": ("specialized", ("camelyon", "pcam")),
    "eurosat": ("specialized", ()),
    "resisc45": ("specialized", ()),
    "diabetic_retinopathy": ("specialized", ("retinopathy", "diabetic_retinopathy_detection")),
    # structured
    "clevr_count": ("structured", ("clevr_count_all",)),
    "clevr_dist": ("structured", ("clevr_closest_object_distance",)),
    "dmlab": ("structured", ()),
    "dsprites_loc": ("structured", ("dspr_loc", "dsprites_label_x_position", "dsprites_xpos")),
    "dsprites_ori": ("structured", ("dspr_ori", "dsprites_label_orientation", "dsprites_orientation")),
    "kitti_dist": ("structured", ("kitti", "kitti_closest_vehicle_distance")),
    "smallnorb_azi": ("structured", ("snorb_azim", "smallnorb_azim", "smallnorb_label_azimuth", "smallnorb_azimuth")),
    "smallnorb_ele": ("structured", ("snorb_elev", "smallnorb_elev", "smallnorb_label_elevation",
                                     "smallnorb_elevation")),
}
GROUPS = ("natural", "specialized", "structured")
SWEEP_SHARE = 0.8  # train800 of 1000
# a result's train_split where the task brought its own two splits, trained as given (whatever --examples)
OWN_SPLITS = "train800/ + val200/"
# the tasks whose labels a random horizontal flip or a random crop changes (an angle, a location, a count, a
# distance): their runs train without it.  Kolesnikov et al. 2020 (BiT), Supplementary F, whose pre-processing
# the paper follows for VTAB (Appendix B.1.1): flipping off for dSprites-orientation, SmallNORB-azimuth and
# dSprites-location, cropping off for Clevr-count, Clevr-distance, DMLab, KITTI-distance and dSprites-location
NO_FLIP = ("dsprites_ori", "smallnorb_azi", "dsprites_loc")
NO_CROP = ("clevr_count", "clevr_dist", "dmlab", "kitti_dist", "dsprites_loc")


def task_augment(name: str) -> dict[str, object]:
    """The augmentation fields a run of task ``name`` (its VTAB name) trains with whatever its recipe's
    (``NO_FLIP``, ``NO_CROP``): {} for a task whose labels survive both."""
    changes: dict[str, object] = {}
    if name in NO_FLIP:
        changes.update({"augment.flip": False, "augment.alternate_flip": False})
    if name in NO_CROP:
        changes["augment.crop"] = "none"
    return changes


def _spelling_key(name: str) -> str:
    """What two spellings of a task share: its letters and digits, lower case (CIFAR-100 = cifar100)."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


ALIASES = {_spelling_key(alias): name for name, (_, aliases) in TASK_GROUPS.items() for alias in (name, *aliases)}


def canonical_task(folder_name: str) -> str | None:
    """The VTAB name of a task folder (``Oxford-Flowers102`` -> ``oxford_flowers102``,
    ``sNORB-Azim`` -> ``smallnorb_azi``), or None."""
    return ALIASES.get(_spelling_key(folder_name))


@dataclass
class Task:
    """One task folder: its VTAB name, group and where its images are."""

    name: str
    group: str
    folder: Path
    train: Path | None = None          # train/ (the fixed split is drawn from it)
    train800: Path | None = None       # or VTAB-1k's own splits
    val200: Path | None = None
    test: Path | None = None           # None: train[examples:]


def find_tasks(root: str | os.PathLike, groups: Mapping[str, str] | None = None) -> list[Task]:
    """The task folders under ``root`` (sorted by group, then name).  ``groups`` gives the
    group of folders whose names are not VTAB's ({"my_task": "natural"}).  A folder
    without the splits it needs is named, with every other such folder, in one error."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"--tasks {root}: not a folder (expected a folder of task folders)")
    groups = dict(groups or {})
    tasks, unknown, missing = [], [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        name = canonical_task(folder.name)
        group = groups.get(folder.name) or (TASK_GROUPS[name][0] if name else None)
        if group is None:
            unknown.append(folder.name)
            continue
        if group not in GROUPS:
            raise DataError(f"--group {folder.name}={group}: allowed groups are {', '.join(GROUPS)}")
        if name and group != TASK_GROUPS[name][0]:  # it moved the task into another group's mean, not the paper's
            raise DataError(f"--group {folder.name}={group}: {folder.name} is VTAB's {name}, of the "
                            f"{TASK_GROUPS[name][0]} group; --group is for folders not named after a VTAB task")
        parts = {p: folder / p for p in ("train", "train800", "val200", "test") if (folder / p).is_dir()}
        own_splits = {"train800", "val200"} <= set(parts)
        if "train" not in parts and not own_splits:
            missing.append(f"{folder.name}/train/ (or {folder.name}/train800/ and val200/)")
        elif own_splits and "test" not in parts:
            missing.append(f"{folder.name}/test/ (beside its train800/ and val200/)")
        tasks.append(Task(name or folder.name, group, folder, parts.get("train"), parts.get("train800"),
                          parts.get("val200"), parts.get("test")))
    if unknown:
        raise DataError(f"--tasks {root}: {', '.join(unknown)}: not a VTAB task name ({', '.join(TASK_GROUPS)}); "
                        "name the folder after its task, or give its group: --group NAME=natural|specialized|"
                        "structured")
    if missing:
        raise DataError(f"--tasks {root}: missing {'; '.join(missing)}: each task needs train/ (and optionally "
                        "test/), or train800/, val200/ and test/, each an ImageFolder of class folders")
    if not tasks:
        raise DataError(f"--tasks {root}: no task folders in it")
    names = [t.name for t in tasks]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise DataError(f"--tasks {root}: more than one folder for {', '.join(doubled)}")
    return sorted(tasks, key=lambda t: (GROUPS.index(t.group), t.name))


def select_tasks(tasks: Sequence[Task], wanted: Sequence[str], root: str | os.PathLike) -> list[Task]:
    """The tasks of ``wanted`` (``--only``; any spelling ``canonical_task`` knows), in ``tasks``' order."""
    keys = {canonical_task(w) or w: w for w in wanted}
    unknown = [w for key, w in keys.items() if key not in {t.name for t in tasks}]
    if unknown:
        raise DataError(f"--only {', '.join(unknown)}: no such task in {root} ({', '.join(t.name for t in tasks)})")
    return [t for t in tasks if t.name in keys]


@dataclass
class TaskSplits:
    """ImageFolder views of one task's splits (links to its files) that share one class list."""

    sweep_train: Path   # train[:800]
    sweep_val: Path     # train[800:1000]
    train: Path         # train[:1000]
    test: Path
    classes: list[str]
    test_split: str     # where the test images come from, as the results state it
    counts: dict[str, int] = field(default_factory=dict)
    # where the training examples come from, as the results state it: a task's own train800/ and val200/ are
    # trained as given, whatever --examples (which the report's protocol alone had claimed for every task)
    train_split: str = ""


def _link(source: str, target: Path) -> None:
    """A link to an image (a copy where the file system has no links)."""
    try:
        os.symlink(os.path.abspath(source), target)
    except OSError:
        shutil.copyfile(source, target)


def _write_view(folder: Path, classes: Sequence[str], items: Sequence[tuple[str, int]]) -> int:
    """``folder/<class>/<n><suffix>`` linking to each (path, label); every class gets a folder,
    so every view of a task has the same class list (and label ids); one without an image of
    the view is marked empty by design."""
    if folder.exists():
        shutil.rmtree(folder)
    for name in classes:
        (folder / name).mkdir(parents=True)
    for name in set(classes) - {classes[label] for _, label in items}:
        (folder / name / EMPTY_CLASS_MARK).touch()
    for n, (path, label) in enumerate(items):
        _link(path, folder / classes[label] / f"{n:07d}{Path(path).suffix.lower()}")
    return len(items)


def _items(index: ImageFolderIndex, classes: Sequence[str]) -> list[tuple[str, int]]:
    """(path, label in ``classes``) of every image of ``index``."""
    ids = [classes.index(c) for c in index.classes]
    return [(path, ids[int(label)]) for path, label in zip(index.paths, index.labels)]


def split_task(task: Task, work: str | os.PathLike, examples: int = 1000, seed: int = 0) -> TaskSplits:
    """Write the views of ``task``'s fixed splits under ``work`` (see the module docstring)."""
    work = Path(work)
    parts = {name: scan_image_folder(path) for name, path in
             (("train", task.train), ("train800", task.train800), ("val200", task.val200), ("test", task.test))
             if path is not None}
    classes = sorted({c for index in parts.values() for c in index.classes})
    test_items = _items(parts["test"], classes) if "test" in parts else None
    if task.train800 is not None and task.val200 is not None:
        sweep_train, sweep_val = _items(parts["train800"], classes), _items(parts["val200"], classes)
        test_split, train_split = "test/", OWN_SPLITS
    else:
        pool = _items(parts["train"], classes)
        if len(pool) < examples:
            raise DataError(f"{task.train}: {len(pool)} training images, fewer than --examples {examples}")
        order = np.random.Generator(np.random.PCG64(seed)).permutation(len(pool))
        shuffled = [pool[i] for i in order]
        cut = int(round(SWEEP_SHARE * examples))
        sweep_train, sweep_val = shuffled[:cut], shuffled[cut:examples]
        test_split, train_split = "test/", f"train[:{cut}] + train[{cut}:{examples}]"
        if test_items is None:
            test_items = shuffled[examples:]
            test_split = f"train[{examples}:]"
            if not test_items:
                raise DataError(f"{task.folder}: no test/ folder, and its training set has no images beyond the "
                                f"{examples} used: nothing to test on")
    if test_items is None:
        raise DataError(f"{task.folder}: train800/ and val200/ need a test/ folder beside them")
    views = TaskSplits(work / "train800", work / "val200", work / "train1000", work / "test", classes, test_split,
                       train_split=train_split)
    views.counts = {
        "train800": _write_view(views.sweep_train, classes, sweep_train),
        "val200": _write_view(views.sweep_val, classes, sweep_val),
        "train1000": _write_view(views.train, classes, sweep_train + sweep_val),
        "test": _write_view(views.test, classes, test_items),
    }
    return views


def split_tasks(tasks: Sequence[Task], out: str | os.PathLike, examples: int = 1000,
                seed: int = 0) -> dict[str, TaskSplits]:
    """Every task's splits (``split_task``, under ``out/<task>/splits``), written before any
    task is trained: what is wrong with any of them is named, for all of them, in one error."""
    if examples < 5:
        raise ConfigError(f"--examples={examples}: must be at least 5 (a 4:1 split)")
    splits, problems = {}, []
    for task in tasks:
        try:
            splits[task.name] = split_task(task, Path(out) / task.name / "splits", examples, seed)
        except DataError as e:
            problems.append(str(e))
    if problems:
        raise DataError("; ".join(problems) + ": nothing was trained")
    return splits


def _group_means(results: Mapping[str, Mapping[str, object]]) -> dict[str, tuple[float | None, int]]:
    """{group: (mean test top-1 or None, tasks)} of ``results``."""
    scores = {group: [float(r["test_top1"]) for r in results.values() if r["group"] == group] for group in GROUPS}
    return {group: (float(np.mean(s)) if s else None, len(s)) for group, s in scores.items()}


def summarize(results: Mapping[str, Mapping[str, object]]) -> dict:
    """Group means and the mean over tasks of ``{task: {"group", "test_top1", ...}}``, as the
    paper reports VTAB: every task counts once in its group and once in the overall mean.  They are
    over VTAB's own tasks; a task of one's own (a folder given its group, ``--group``) entered them, and a mean
    over 20 tasks was labelled as VTAB's ("20 of 19 tasks").  Such tasks are ``own_tasks``: their names, and the
    means of their groups and over every task with them, apart."""
    vtab = {name: r for name, r in results.items() if name in TASK_GROUPS}
    groups = {group: {"mean": mean, "tasks": n, "of": sum(g == group for g, _ in TASK_GROUPS.values())}
              for group, (mean, n) in _group_means(vtab).items()}
    scores = [float(r["test_top1"]) for r in vtab.values()]
    summary = {"groups": groups, "mean": float(np.mean(scores)) if scores else None, "scored": len(scores),
               "of": len(TASK_GROUPS), "missing": [n for n in TASK_GROUPS if n not in results]}
    own = [name for name in results if name not in TASK_GROUPS]
    if own:
        summary["own_tasks"] = {
            "tasks": own, "mean": float(np.mean([float(r["test_top1"]) for r in results.values()])),
            "scored": len(results),
            "groups": {group: {"mean": mean, "tasks": n, "own": [t for t in own if results[t]["group"] == group]}
                       for group, (mean, n) in _group_means(results).items()
                       if any(results[t]["group"] == group for t in own)}}
    return summary


def selection_words(protocol: Mapping[str, object]) -> str | None:
    """How the final runs' learning rates were chosen, in words (a report's ``protocol``: its ``grid`` and
    ``select``), None where it does not say: the table printed the rates alone, and a mean of rates chosen per
    task read as the paper's, whose one setting is chosen for all tasks."""
    grid, select = list(protocol.get("grid") or ()), protocol.get("select")
    if not grid or select is None:
        return None
    if len(grid) == 1:
        return f"Learning rate {grid[0]:g} for every task (a grid of one: none chosen)"
    rates = ", ".join(f"{lr:g}" for lr in grid)
    if select == "shared":
        return (f"Learning rate: of {rates}, the one best on the mean over the tasks' validation examples, for every "
                "task (--select shared: the paper's one setting for all tasks)")
    return (f"Learning rate: each task's own, of {rates} the one best on its validation examples (--select "
            "per-task; the paper chose one setting for all tasks: --select shared)")


def format_table(results: Mapping[str, Mapping[str, object]], summary: Mapping[str, object]) -> str:
    """The per-task table with the learning rate chosen, then the group means and the mean over VTAB's tasks, the
    means with one's own tasks apart (``summarize``'s ``own_tasks``, each such task's row marked "own"), and how the
    rates were chosen (``selection_words``) where ``summary`` holds its ``protocol``."""
    def percent(mean: float | None, width: int) -> str:
        return f"{'-' if mean is None else f'{100 * mean:.2f}%':>{width}}"

    rows = [f"{'task':<22} {'group':<12} {'lr':>7}  {'val-200 top-1 per lr':<34} {'test top-1':>10}  test images"]
    for name, r in results.items():
        val = "  ".join(f"{lr}: " + ("diverged" if acc is None else f"{100 * acc:.1f}")
                        for lr, acc in dict(r.get("val_top1") or {}).items()) or "-"
        shown = name if name in TASK_GROUPS else f"{name} (own)"
        rows.append(f"{shown:<22} {r['group']:<12} {r['lr']:>7g}  {val:<34} {100 * float(r['test_top1']):>9.2f}%  "
                    f"{r['test_examples']} ({r['test_split']})")
    examples = (summary.get("protocol") or {}).get("examples")
    for name, r in results.items() if examples else ():  # trained as given: not the --examples of the protocol
        val, cut = r.get("val_examples"), int(round(SWEEP_SHARE * examples))
        if r.get("train_split") == OWN_SPLITS and (r["train_examples"] - val, val) != (cut, examples - cut):
            rows.append(f"{name}: its own train800/ and val200/ as given ({r['train_examples'] - val} + {val} images), "
                        f"not --examples {examples}")
    rows.append("")
    for group, g in summary["groups"].items():
        rows.append(f"{group.capitalize() + ' mean':<22} {percent(g['mean'], 8)}  ({g['tasks']} of VTAB's {g['of']} "
                    "tasks)")
    rows.append(f"{'Mean over tasks':<22} {percent(summary['mean'], 8)}  ({summary['scored']} of VTAB's "
                f"{summary['of']} tasks{'; missing: ' + ', '.join(summary['missing']) if summary['missing'] else ''})")
    own = summary.get("own_tasks")
    for group, g in (own or {}).get("groups", {}).items():  # not VTAB's means: labelled as one's own
        rows.append(f"{group.capitalize() + ' mean + own':<22} {percent(g['mean'], 8)}  ({g['tasks']} tasks: "
                    f"{g['tasks'] - len(g['own'])} of VTAB's and {', '.join(g['own'])}, not VTAB's)")
    if own:
        rows.append(f"{'Mean over tasks + own':<22} {percent(own['mean'], 8)}  ({own['scored']} tasks: "
                    f"{own['scored'] - len(own['tasks'])} of VTAB's and {', '.join(own['tasks'])}, not VTAB's)")
    chosen = selection_words(summary.get("protocol") or {})
    return "\n".join(rows + ([chosen] if chosen else []))
