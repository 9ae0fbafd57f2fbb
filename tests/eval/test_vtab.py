"""`vitlab vtab`: the VTAB-1k protocol end to end on three tiny tasks built here, one per group
and one per folder layout, and its parts (task names, fixed splits, means, accumulation)."""
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data.sources import DataError
from vitlab.eval.vtab import TASK_GROUPS, canonical_task, find_tasks, select_tasks, split_task, summarize

CLASSES = ("a", "b", "c")


def image_folder(root: Path, per_class: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (16, 16, 3), dtype=np.uint8)
            pixels[:, :, c] += 150  # each class its own colour: learnable in a few steps
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """cifar100 (train/ + test/), eurosat (train/ only: its test set is the rest of train),
    dsprites_loc (VTAB-1k's own train800/ + val200/, and test/)."""
    root = tmp_path_factory.mktemp("vtab")
    image_folder(root / "cifar100" / "train", 8, 0)
    image_folder(root / "cifar100" / "test", 3, 1)
    image_folder(root / "EuroSAT" / "train", 10, 2)
    image_folder(root / "dsprites_loc" / "train800", 5, 3)
    image_folder(root / "dsprites_loc" / "val200", 2, 4)
    image_folder(root / "dsprites_loc" / "test", 3, 5)
    return root


def targets(folder: Path) -> set[str]:
    return {os.path.realpath(p) for p in folder.rglob("*.png")}



def tiny_vtab(checkpoint: str, tasks, out, steps: int) -> list[str]:
    """`vitlab vtab` of the tiny checkpoint over ``tasks``: 20 examples, two learning rates, fp32."""
    return ["vtab", "--init", checkpoint, "--tasks", str(tasks), "--examples", "20", "--steps", str(steps),
            "--batch-size", "8", "--img-size", "16", "--grid", "0.003,0.03", "--out", str(out), "--quiet",
            "--set", "run.precision=fp32", "--set", "run.threads=1", "--set", "run.tensorboard=false",
            "--set", "data.decode_workers=0"]


def finished_eurosat_run(checkpoint: str, tasks, out, capsys) -> tuple[list[str], Path, int]:
    """One finished tiny run of eurosat at lr 0.01 into ``out``: (its command's arguments, its final
    run's summary.json, that file's mtime), the command's output taken."""
    args = [*tiny_vtab(checkpoint, tasks, out, steps=1), "--only", "eurosat", "--grid", "0.01"]
    assert main(args) == 0
    capsys.readouterr()
    summary = out / "eurosat" / "final_lr_0.01" / "summary.json"
    return args, summary, summary.stat().st_mtime_ns


def test_task_names_groups_and_layouts(tasks, tmp_path):
    assert canonical_task("Oxford-Flowers102") == "oxford_flowers102" and canonical_task("kitti") == "kitti_dist"
    assert sum(g == "natural" for g, _ in TASK_GROUPS.values()) == 7 and len(TASK_GROUPS) == 19
    found = find_tasks(tasks)
    assert [(t.name, t.group) for t in found] == [("cifar100", "natural"), ("eurosat", "specialized"),
                                                 ("dsprites_loc", "structured")]
    (tmp_path / "mine" / "train" / "x").mkdir(parents=True)
    with pytest.raises(DataError, match="not a VTAB task name.*--group"):
        find_tasks(tmp_path)
    assert find_tasks(tmp_path, {"mine": "structured"})[0].group == "structured"
    # a VTAB task keeps its own group: --group moved it into another group's mean without a word
    (tmp_path / "CIFAR-100" / "train" / "x").mkdir(parents=True)
    assert find_tasks(tmp_path, {"mine": "natural", "CIFAR-100": "natural"})[0].name == "cifar100"
    with pytest.raises(DataError, match=r"^--group CIFAR-100=structured: CIFAR-100 is VTAB's cifar100, of the "
                                        "natural group; --group is for folders not named after a VTAB task$"):
        find_tasks(tmp_path, {"mine": "natural", "CIFAR-100": "structured"})


# the paper's Table 9 columns, as it spells them, and the VTAB task each names
TABLE_9 = {"Caltech101": "caltech101", "CIFAR-100": "cifar100", "DTD": "dtd", "Flowers102": "oxford_flowers102",
           "Pets": "oxford_iiit_pet", "Sun397": "sun397", "SVHN": "svhn", "Camelyon": "patch_camelyon",
           "EuroSAT": "eurosat", "Resisc45": "resisc45", "Retinopathy": "diabetic_retinopathy",
           "Clevr-Count": "clevr_count", "Clevr-Dist": "clevr_dist", "DMLab": "dmlab", "dSpr-Loc": "dsprites_loc",
           "dSpr-Ori": "dsprites_ori", "KITTI-Dist": "kitti_dist", "sNORB-Azim": "smallnorb_azi",
           "sNORB-Elev": "smallnorb_ele"}


def test_the_papers_task_names_in_any_case_and_punctuation(tmp_path):
    assert sorted(TABLE_9.values()) == sorted(TASK_GROUPS)  # all 19, each once
    for paper, name in TABLE_9.items():
        for spelling in (paper, paper.upper(), paper.lower(), paper.replace("-", "_"), paper.replace("-", " ")):
            assert canonical_task(spelling) == name, spelling
    for name in TASK_GROUPS:  # and today's names, likewise
        assert canonical_task(name.upper().replace("_", "-")) == canonical_task(name) == name
    for paper in ("CIFAR-100", "dSpr-Loc", "sNORB-Azim"):
        (tmp_path / paper / "train" / "a").mkdir(parents=True)
    found = find_tasks(tmp_path)
    assert [t.name for t in found] == ["cifar100", "dsprites_loc", "smallnorb_azi"]
    assert [t.name for t in select_tasks(found, ["snorb azim", "CIFAR100"], tmp_path)] == ["cifar100",
                                                                                         "smallnorb_azi"]
    with pytest.raises(DataError, match="--only dtd: no such task"):
        select_tasks(found, ["dtd"], tmp_path)


def test_every_tasks_folders_are_checked_before_any_training(tiny_checkpoint, tmp_path, capsys):
    """A good task first, then two that cannot run: refused in one line, first for the folder that is
    missing, then for the images that are; nothing trained either time."""
    root = tmp_path / "tasks"
    image_folder(root / "cifar100" / "train", 8, 0)
    image_folder(root / "cifar100" / "test", 3, 1)
    image_folder(root / "DTD" / "train800", 5, 2)   # VTAB-1k's own splits, but no test/
    image_folder(root / "DTD" / "val200", 2, 3)
    image_folder(root / "EuroSAT" / "train", 20 // 3, 4)  # 18 images: fewer than --examples 20
    out = tmp_path / "vtab"
    args = tiny_vtab(tiny_checkpoint, root, out, steps=1)
    assert main(args) == 2
    assert not list(out.rglob("summary.json")) and not list(out.glob("cifar100/lr_*"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DTD/test/" in err[0], err
    image_folder(root / "DTD" / "test", 3, 5)  # the folder given: now the image count of the other
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EuroSAT/train: 18 training images, fewer than --examples 20" in err[0], err
    assert "nothing was trained" in err[0] and not list(out.rglob("summary.json"))


def test_the_split_is_fixed_disjoint_and_four_to_one(tasks, tmp_path):
    cifar = find_tasks(tasks)[0]
    views = split_task(cifar, tmp_path / "one", examples=20, seed=0)
    again = split_task(cifar, tmp_path / "two", examples=20, seed=0)
    other = split_task(cifar, tmp_path / "three", examples=20, seed=1)
    assert views.counts == {"train800": 16, "val200": 4, "train1000": 20, "test": 9}
    sweep, held, final = targets(views.sweep_train), targets(views.sweep_val), targets(views.train)
    assert not sweep & held and sweep | held == final and len(final) == 20
    assert targets(again.sweep_val) == held and targets(other.sweep_val) != held  # fixed by the seed
    # every view holds every class folder, so labels agree between them
    assert all(sorted(p.name for p in v.iterdir()) == list(CLASSES)
               for v in (views.sweep_train, views.sweep_val, views.train, views.test))
    eurosat = split_task(find_tasks(tasks)[1], tmp_path / "e", examples=20, seed=0)
    assert eurosat.test_split == "train[20:]" and eurosat.counts["test"] == 10
    assert not targets(eurosat.test) & targets(eurosat.train)
    with pytest.raises(DataError, match="fewer than --examples 40"):
        split_task(find_tasks(tasks)[1], tmp_path / "f", examples=40)


def test_a_view_holds_its_empty_classes_quietly_and_other_trees_still_warn(tmp_path, caplog):
    """The 200 validation examples may miss a class: its folder in the view is empty by design,
    and marked so, so reading the view warns of nothing; an unmarked empty class folder (the
    user's own) is still named."""
    import logging

    from vitlab.data.memory import load_in_memory

    root = tmp_path / "tasks"
    image_folder(root / "cifar100" / "train", 4, 0)
    (root / "cifar100" / "train" / "d").mkdir()  # a class without images: the user's, warned of
    with caplog.at_level(logging.WARNING):
        views = split_task(find_tasks(root)[0], tmp_path / "splits", examples=5, seed=0)
    assert "1 class folder(s) hold no images: d" in caplog.text
    assert views.counts["val200"] == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        data = load_in_memory(views.sweep_val, image_size=16, cache_dir=tmp_path / "cache", workers=0)
    assert data.classes == [*CLASSES, "d"] and len(data.labels) == 1  # every class folder, one image
    assert "hold no images" not in caplog.text
    from vitlab.data.sources import EMPTY_CLASS_MARK

    marked = sorted(p.parent.name for p in views.sweep_val.glob(f"*/{EMPTY_CLASS_MARK}"))
    assert len(marked) == 3 and "d" in marked  # the three classes the one image is not of
    (views.sweep_val / marked[0] / EMPTY_CLASS_MARK).unlink()  # unmarked: told again
    with caplog.at_level(logging.WARNING):
        load_in_memory(views.sweep_val, image_size=16, cache_dir=tmp_path / "cache2", workers=0)
    assert f"1 class folder(s) hold no images: {marked[0]}" in caplog.text


def test_the_final_learning_rate_per_task_or_shared():
    from vitlab.train.vtab import chosen_lrs

    val = {"a": {"0.01": 0.9, "0.03": 0.5}, "b": {"0.01": 0.2, "0.03": 0.7}, "c": {"0.01": 0.1, "0.03": 0.5}}
    assert chosen_lrs((0.01, 0.03), val, "per-task") == {"a": 0.01, "b": 0.03, "c": 0.03}
    assert chosen_lrs((0.01, 0.03), val, "shared") == {"a": 0.03, "b": 0.03, "c": 0.03}  # 1.7 against 1.2
    assert chosen_lrs((0.003,), {"a": {}, "b": {}}, "per-task") == {"a": 0.003, "b": 0.003}


def test_means_are_per_group_and_over_tasks():
    results = {"cifar100": {"group": "natural", "test_top1": 0.9}, "dtd": {"group": "natural", "test_top1": 0.5},
               "eurosat": {"group": "specialized", "test_top1": 0.8}}
    s = summarize(results)
    assert s["groups"]["natural"] == {"mean": pytest.approx(0.7), "tasks": 2, "of": 7}
    assert s["groups"]["structured"]["mean"] is None and s["mean"] == pytest.approx(2.2 / 3)
    assert len(s["missing"]) == 16 and "dtd" not in s["missing"]


def test_a_task_of_ones_own_is_kept_out_of_vtabs_means():
    """A folder given its group (--group mine=natural) entered VTAB's means: the table printed "(20 of 19 tasks)" and
    "(8 of 7 tasks)", and the mean over tasks, the paper's over its 19, held it.  VTAB's means are its own tasks';
    one's own task is in its row, marked, and in means apart, labelled as not VTAB's."""
    from vitlab.eval.vtab import format_table

    results = {name: {"group": group, "lr": 0.01, "test_top1": 0.5, "test_examples": 9, "test_split": "test/"}
               for name, (group, _) in TASK_GROUPS.items()}
    results["mine"] = {"group": "natural", "lr": 0.01, "test_top1": 1.0, "test_examples": 9, "test_split": "test/"}
    s = summarize(results)
    assert (s["mean"], s["scored"], s["of"], s["missing"]) == (0.5, 19, 19, [])
    assert s["groups"]["natural"] == {"mean": 0.5, "tasks": 7, "of": 7}
    assert s["own_tasks"] == {"tasks": ["mine"], "mean": pytest.approx(10.5 / 20), "scored": 20,
                              "groups": {"natural": {"mean": pytest.approx(4.5 / 8), "tasks": 8, "own": ["mine"]}}}
    table = format_table(results, s)
    assert "(20 of 19" not in table and "(8 of 7" not in table
    lines = table.splitlines()
    assert lines[-6:] == ["Natural mean             50.00%  (7 of VTAB's 7 tasks)",
                          "Specialized mean         50.00%  (4 of VTAB's 4 tasks)",
                          "Structured mean          50.00%  (8 of VTAB's 8 tasks)",
                          "Mean over tasks          50.00%  (19 of VTAB's 19 tasks)",
                          "Natural mean + own       56.25%  (8 tasks: 7 of VTAB's and mine, not VTAB's)",
                          "Mean over tasks + own    52.50%  (20 tasks: 19 of VTAB's and mine, not VTAB's)"]
    assert any(line.startswith("mine (own) ") for line in lines)
    assert "own_tasks" not in summarize({k: v for k, v in results.items() if k != "mine"})
    alone = summarize({"mine": results["mine"]})  # no VTAB task: no VTAB mean
    assert (alone["mean"], alone["scored"], alone["own_tasks"]["mean"]) == (None, 0, 1.0)
    assert f"Mean over tasks{' ' * 15}-  (0 of VTAB's 19 tasks; missing: " in format_table({"mine": results["mine"]},
                                                                                         alone)


def test_the_table_says_where_a_tasks_own_splits_differ_from_the_examples():
    from vitlab.eval.vtab import format_table

    row = {"group": "natural", "lr": 0.01, "test_top1": 0.5, "test_examples": 9, "test_split": "test/",
           "train_split": "train800/ + val200/", "train_examples": 1000, "val_examples": 200}
    as_given = {"dtd": row, "svhn": {**row, "train_examples": 500, "val_examples": 100}}
    notes = [line for line in format_table(as_given, {**summarize(as_given), "protocol": {"examples": 1000}})
             .splitlines() if "as given" in line]
    assert notes == ["svhn: its own train800/ and val200/ as given (400 + 100 images), not --examples 1000"]


def test_the_table_says_how_the_learning_rates_were_chosen():
    """The table printed each task's rate alone: a mean of rates chosen per task (the default) read as the paper's,
    whose one setting is chosen for all tasks by their mean on the 200-example validation sets."""
    from vitlab.eval.vtab import format_table

    results = {"cifar100": {"group": "natural", "lr": 0.01, "val_top1": {"0.01": 0.5, "0.03": 0.4},
                            "test_top1": 0.5, "test_examples": 9, "test_split": "test/"}}
    lines = {select: format_table(results, {**summarize(results), "protocol": {"grid": grid, "select": select}})
             .splitlines()[-1] for select, grid in (("per-task", [0.01, 0.03]), ("shared", [0.01, 0.03]))}
    assert lines["per-task"] == ("Learning rate: each task's own, of 0.01, 0.03 the one best on its validation "
                                 "examples (--select per-task; the paper chose one setting for all tasks: --select "
                                 "shared)")
    assert lines["shared"].endswith("for every task (--select shared: the paper's one setting for all tasks)")
    one = format_table(results, {**summarize(results), "protocol": {"grid": [0.01], "select": "per-task"}})
    assert one.splitlines()[-1] == "Learning rate 0.01 for every task (a grid of one: none chosen)"
    assert format_table(results, summarize(results)).splitlines()[-1].startswith("Mean over tasks")  # none said


def test_vtab_end_to_end(tasks, tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "vtab"
    args = tiny_vtab(tiny_checkpoint, tasks, out, steps=3)
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed.strip().splitlines()[-1])
    assert report == json.loads((out / "vtab.json").read_text())
    assert report["protocol"]["accum_steps"] == 1 and report["protocol"]["steps"] == 3
    tasks_ = report["tasks"]
    assert list(tasks_) == ["cifar100", "eurosat", "dsprites_loc"]
    for name, r in tasks_.items():
        assert set(r["val_top1"]) == {"0.003", "0.03"}
        assert r["lr"] == float(max(r["val_top1"], key=r["val_top1"].get))  # the best on its 200 (here 4)
        assert 0.0 <= r["test_top1"] <= 1.0 and r["classes"] == 3 and r["skipped_images"] == 0
    assert (tasks_["cifar100"]["test_split"], tasks_["cifar100"]["test_examples"]) == ("test/", 9)
    assert (tasks_["eurosat"]["test_split"], tasks_["eurosat"]["test_examples"]) == ("train[20:]", 10)
    assert tasks_["dsprites_loc"]["train_examples"] == 3 * (5 + 2)  # train800/ + val200/ as given
    # and said so: the protocol's --examples 20 alone was recorded for every task
    assert [(r["train_split"], r["val_examples"]) for r in tasks_.values()] == [
        ("train[:16] + train[16:20]", 4), ("train[:16] + train[16:20]", 4), ("train800/ + val200/", 6)]
    notes = [line for line in printed.splitlines() if "not --examples" in line]
    assert notes == ["dsprites_loc: its own train800/ and val200/ as given (15 + 6 images), not --examples 20"]
    for group, name in (("natural", "cifar100"), ("specialized", "eurosat"), ("structured", "dsprites_loc")):
        assert report["groups"][group]["mean"] == pytest.approx(tasks_[name]["test_top1"])
    assert report["mean"] == pytest.approx(np.mean([r["test_top1"] for r in tasks_.values()]))
    for line in ("Natural mean", "Specialized mean", "Structured mean", "Mean over tasks", "(3 of VTAB's 19 tasks",
                 "Learning rate: each task's own, of 0.003, 0.03 the one best on its validation examples"):
        assert line in printed
    # the paper's one setting for all tasks, from the same runs (--resume reruns nothing)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
    assert main([*args, "--select", "shared", "--resume"]) == 0
    printed = capsys.readouterr().out
    shared = json.loads(printed.strip().splitlines()[-1])
    assert "for every task (--select shared: the paper's one setting for all tasks)" in printed
    assert all(p.stat().st_mtime_ns == stamp for p, stamp in stamps.items())
    best = max(("0.003", "0.03"), key=lambda lr: sum(r["val_top1"][lr] for r in tasks_.values()))
    assert {r["lr"] for r in shared["tasks"].values()} == {float(best)}


def test_tasks_whose_labels_a_flip_or_a_crop_changes_train_without_it(tasks, tiny_checkpoint, tmp_path, capsys):
    """Every task trained with the recipe's inception crop and flip: a flipped dSprites image kept the
    location label of the unflipped one (and a crop moved it), a flipped sNORB azimuth or dSprites orientation
    was mirrored, a crop dropped Clevr's counted objects.  BiT's Supplementary F (the pre-processing the
    paper follows) trains those without them; the report says how each task trained."""
    out = tmp_path / "vtab"
    assert main(tiny_vtab(tiny_checkpoint, tasks, out, steps=1)) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trained = {"cifar100": ("inception", True), "eurosat": ("inception", True), "dsprites_loc": ("none", False)}
    for name, (crop, flip) in trained.items():
        runs = sorted((out / name).glob("*lr_*/config.json"))
        assert len(runs) == 3  # the grid's two rates and the final run
        for run in runs:
            augment = json.loads(run.read_text())["augment"]
            assert (augment["crop"], augment["flip"]) == (crop, flip), run
    assert {name: r["augment"] for name, r in report["tasks"].items()} == {
        name: {"crop": crop, "flip": flip} for name, (crop, flip) in trained.items()}
    from vitlab.eval.vtab import task_augment

    assert {name: task_augment(name) for name in TASK_GROUPS if task_augment(name)} == {
        "dsprites_ori": {"augment.flip": False, "augment.alternate_flip": False},
        "smallnorb_azi": {"augment.flip": False, "augment.alternate_flip": False},
        "dsprites_loc": {"augment.flip": False, "augment.alternate_flip": False, "augment.crop": "none"},
        "clevr_count": {"augment.crop": "none"}, "clevr_dist": {"augment.crop": "none"},
        "dmlab": {"augment.crop": "none"}, "kitti_dist": {"augment.crop": "none"}}


def test_a_view_is_scored_with_the_configs_own_decode_workers(tasks, tiny_checkpoint, tmp_path):
    """``evaluate_on`` with a resolved config's decoding processes (``run_vtab`` passes its
    resolution's; the e2e test sets 0)."""
    from vitlab.train.vtab import evaluate_on
    from vitlab.train.config import TrainConfig
    from vitlab.train.overrides import with_changes

    cfg = with_changes(TrainConfig(), {"data.cache_dir": str(tmp_path / "cache"), "data.decode_workers": 2})
    top1, n, _ = evaluate_on(tiny_checkpoint, tasks / "cifar100" / "test", cfg, "cpu", "fp32")
    assert n == 9 and 0.0 <= top1 <= 1.0


def test_the_test_sets_are_scored_in_the_runs_threads(tasks, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    # each run trains in run.threads; its views were scored after it, in the caller's PyTorch count
    import vitlab.train.vtab as vtab

    scored = []

    def evaluate_on(*args, **kwargs):
        scored.append(torch.get_num_threads())
        return original(*args, **kwargs)

    original = vtab.evaluate_on
    monkeypatch.setattr(vtab, "evaluate_on", evaluate_on)
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main([*tiny_vtab(tiny_checkpoint, tasks, tmp_path / "vtab", steps=1), "--only", "eurosat"]) == 0
        assert torch.get_num_threads() == 2  # the caller's given back
    finally:
        torch.set_num_threads(caller)
    assert scored == [1, 1, 1]  # the two rates' validation examples and the test set, in run.threads=1
    capsys.readouterr()


def test_an_unreadable_test_image_is_counted_in_the_tasks_result(tasks, tiny_checkpoint, tmp_path):
    import shutil

    from vitlab.train.vtab import evaluate_on
    from vitlab.train.config import TrainConfig
    from vitlab.train.overrides import with_changes

    test = tmp_path / "test"
    shutil.copytree(tasks / "cifar100" / "test", test)
    (test / "a" / "broken.png").write_bytes(b"not a png")
    cfg = with_changes(TrainConfig(), {"data.cache_dir": str(tmp_path / "cache"), "data.decode_workers": 0})
    top1, n, unread = evaluate_on(tiny_checkpoint, test, cfg, "cpu", "fp32")
    assert (n, unread) == (9, 1) and 0.0 <= top1 <= 1.0


def test_vtab_json_is_the_old_or_the_new_report_when_the_disk_fills_up(tasks, tiny_checkpoint, tmp_path, capsys,
                                                                        monkeypatch):
    # written in place, a full disk at vtab.json left it truncated: the finished protocol's report was lost
    from helpers.full_disk import fill_disk_at

    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat", "--grid", "0.01"]
    assert main(args) == 0
    report, files = (out / "vtab.json").read_text(), sorted(p.name for p in out.iterdir())
    fill_disk_at(monkeypatch, "vtab.json")
    assert main([*args, "--resume"]) != 0
    monkeypatch.undo()
    capsys.readouterr()
    assert (out / "vtab.json").read_text() == report
    assert sorted(p.name for p in out.iterdir()) == files  # no temporary file left


def test_a_second_run_into_the_same_out_keeps_or_refuses_the_finished_runs(tasks, tiny_checkpoint, tmp_path, capsys):
    """Run again without --resume, the finished runs were all trained again over the earlier ones
    without a word; with --resume and other --steps (or --split-seed, whose views are rewritten:
    the runs were scored on images they had trained on), their summaries were read back as fresh."""
    out = tmp_path / "vtab"
    args, summary, stamp = finished_eurosat_run(tiny_checkpoint, tasks, out, capsys)
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab vtab: error: --out={str(out)!r} holds 1 finished run(s) of these tasks (eurosat/final_lr_0.01, ...); "
        "keep them with --resume, train them again with --overwrite, or choose another --out")
    for changed, line in ((["--steps", "2"], "optim.steps=2 (its runs: 1)"),
                          (["--split-seed", "1"], "split_seed=1 (its runs: 0)")):
        assert main([*args, *changed, "--resume"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"vitlab vtab: error: --resume: the runs of eurosat in {out} were made with other settings: {line}; "
            "resume with the same ones, or train again with --overwrite or into another --out")
    assert summary.stat().st_mtime_ns == stamp
    assert main([*args, "--resume"]) == 0 and summary.stat().st_mtime_ns == stamp  # the same settings: kept
    assert main([*args, "--steps", "2", "--overwrite"]) == 0
    assert json.loads(summary.read_text())["steps"] == 2
    assert main([*args, "--steps", "2", "--resume"]) == 0  # the record follows the runs trained again


def test_resume_takes_another_examples_for_a_task_of_its_own_train800_and_val200(tasks, tiny_checkpoint, tmp_path,
                                                                                 capsys):
    """A task's own train800/ and val200/ are trained as given whatever --examples: its runs, made as they would be
    now, were refused a --resume with another --examples (or --split-seed); a task cut from train/ still is."""
    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "dsprites_loc", "--grid", "0.01"]
    assert main(args) == 0
    summary = out / "dsprites_loc" / "final_lr_0.01" / "summary.json"
    stamp = summary.stat().st_mtime_ns
    capsys.readouterr()
    assert main([*args, "--examples", "15", "--split-seed", "1", "--resume"]) == 0
    assert summary.stat().st_mtime_ns == stamp  # read back, not trained again
    capsys.readouterr()
    eurosat = [*args[:args.index("--only") + 1], "eurosat", "--grid", "0.01"]
    assert main(eurosat) == 0
    capsys.readouterr()
    assert main([*eurosat, "--examples", "15", "--resume"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab vtab: error: --resume: the runs of eurosat in {out} were made with other settings: examples=15 (its "
        "runs: 20); resume with the same ones, or train again with --overwrite or into another --out")


def test_resume_from_another_folder_scores_the_runs_own_weights(tasks, tiny_checkpoint, tmp_path, capsys,
                                                                 monkeypatch):
    """A finished run's summary named its weights relative to the folder vtab ran in: --resume from another
    folder scored a file of that name there, or none.  Read back, the run's weights are those in its folder."""
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work)
    args, summary, _ = finished_eurosat_run(tiny_checkpoint, tasks, Path("vtab"), capsys)
    written = json.loads(summary.read_text())
    assert written["weights"] == str(work / "vtab" / "eurosat" / "final_lr_0.01" / "model.safetensors")
    # as a summary of before recorded it, from work/
    summary.write_text(json.dumps({**written, "weights": "vtab/eurosat/final_lr_0.01/model.safetensors"}))
    monkeypatch.chdir(work / "sub")
    assert main([*args[:args.index("--out") + 1], "../vtab", *args[args.index("--out") + 2:], "--resume"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]["eurosat"]
    assert os.path.samefile(report["weights"], written["weights"]) and report["test_top1"] is not None


def test_run_vtab_trains_each_run_on_its_whole_view_whatever_the_recipes_split(tasks, tiny_checkpoint, tmp_path):
    """The vtab1k recipe's own 800/200 of 1000 (data.train_examples, data.val_split), here at a
    twentieth of its size, given to run_vtab as its docstring does: each run held a further part of
    its view out, so the final run trained on 8 of the 20 examples the report said it had."""
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import with_changes
    from vitlab.train.vtab import run_vtab

    out = tmp_path / "vtab"
    cfg = with_changes(load_recipe("vtab1k"), {
        "model.init": tiny_checkpoint, "model.img_size": 16, "optim.steps": 1, "optim.batch_size": 8,
        "data.train_examples": 12, "data.val_split": 4, "data.decode_workers": 0, "data.cache_dir": str(tmp_path / "c"),
        "run.out": str(out), "run.precision": "fp32", "run.threads": 1, "run.tensorboard": False})
    report = run_vtab(cfg, select_tasks(find_tasks(tasks), ["eurosat"], tasks), out, examples=20,
                      grid=(0.003, 0.03), verbose=False)
    for run, examples in (("lr_0.003", 16), ("lr_0.03", 16), ("final_lr_*", 20)):
        summary = json.loads(next((out / "eurosat").glob(f"{run}/summary.json")).read_text())
        assert (summary["train_examples"], summary["val_examples"]) == (examples, 0), run
    assert report["tasks"]["eurosat"]["train_examples"] == 20


def test_resume_refuses_runs_made_with_another_schedule_optimiser_or_augmentation(tasks, tiny_checkpoint, tmp_path,
                                                                                  capsys):
    """--resume read the finished runs back whatever the optimiser, schedule or augmentation now asked: a
    --set optim.weight_decay=0.1 was reported as the protocol's setting, on runs trained without it."""
    out = tmp_path / "vtab"
    args, summary, stamp = finished_eurosat_run(tiny_checkpoint, tasks, out, capsys)
    for changed, line in ((["--set", "optim.weight_decay=0.1"], "optim.weight_decay=0.1 (its runs: 0.0)"),
                          (["--set", "augment.flip=false"], "augment.flip=False (its runs: True)"),
                          (["--set", "optim.clip_norm=0"], "optim.clip_norm=0.0 (its runs: 1.0)")):
        assert main([*args, *changed, "--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--resume: the runs of eurosat in {out} were made with other settings: {line};" in err, err
    assert summary.stat().st_mtime_ns == stamp
    assert main([*args, "--resume"]) == 0 and summary.stat().st_mtime_ns == stamp


def test_resume_refuses_runs_made_in_another_arithmetic_than_auto_resolves_to_now(tasks, tiny_checkpoint, tmp_path,
                                                                                  capsys, monkeypatch):
    """settings.json recorded run.precision as asked, "auto": where it resolved otherwise on --resume (a calibration
    stored since), the tasks left trained and scored in another arithmetic than the finished ones, without a word."""
    from vitlab import fast

    out = tmp_path / "vtab"
    monkeypatch.setattr(fast, "cpu_precision", lambda *a, **k: "fp32")  # auto's answer on this CPU then
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat", "--grid", "0.01",
            "--set", "run.precision=auto", "--set", "run.device=cpu"]
    assert main(args) == 0
    capsys.readouterr()
    summary = out / "eurosat" / "final_lr_0.01" / "summary.json"
    stamp = summary.stat().st_mtime_ns
    record = json.loads((out / "settings.json").read_text())
    assert record["eurosat"]["run.precision"] == "fp32"  # as it resolved
    monkeypatch.setattr(fast, "cpu_precision", lambda *a, **k: "bf16")  # and now
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert (f"--resume: the runs of eurosat in {out} were made with other settings: run.precision='bf16' "
            "(its runs: 'fp32');") in err, err
    assert summary.stat().st_mtime_ns == stamp
    # a record of before the precision was resolved is read as the runs' config.json recorded it
    record["eurosat"]["run.precision"] = "auto"
    (out / "settings.json").write_text(json.dumps(record))
    assert main([*args, "--resume"]) == 2
    assert "run.precision='bf16' (its runs: 'fp32');" in capsys.readouterr().err
    monkeypatch.setattr(fast, "cpu_precision", lambda *a, **k: "fp32")
    assert main([*args, "--resume"]) == 0 and summary.stat().st_mtime_ns == stamp
    assert json.loads((out / "settings.json").read_text())["eurosat"]["run.precision"] == "fp32"


def test_resume_reads_an_auto_record_as_the_precision_its_runs_recorded(tmp_path):
    """A settings.json of before the precision was resolved says "auto": --resume took today's resolution
    whatever the finished runs had trained in, and rewrote the record with it.  The runs' config.json say."""
    from vitlab.config import ConfigError
    from vitlab.train.vtab import SETTINGS_NAME, check_earlier_runs

    out = tmp_path / "vtab"
    now = {"eurosat": {"run.precision": "bf16", "optim.steps": 1}}
    (out / "eurosat" / "lr_0.01").mkdir(parents=True)
    (out / "eurosat" / "lr_0.01" / "summary.json").write_text("{}")
    (out / SETTINGS_NAME).write_text(json.dumps({"eurosat": {"run.precision": "auto", "optim.steps": 1}}))
    config = out / "eurosat" / "lr_0.01" / "config.json"
    config.write_text(json.dumps({"run": {"precision": "fp32"}, "resolved": {"precision": "fp32"}}))
    with pytest.raises(ConfigError, match=re.escape(f"--resume: the runs of eurosat in {out} were made with other "
                                                    "settings: run.precision='bf16' (its runs: 'fp32');")):
        check_earlier_runs(out, now, resume=True, overwrite=False)
    # a stopped run's record counts as a finished one's
    (out / "eurosat" / "lr_0.01" / "summary.json").unlink()
    (out / "eurosat" / "lr_0.01" / "checkpoints").mkdir()
    (out / "eurosat" / "lr_0.01" / "checkpoints" / "ckpt-00000001.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="run.precision='bf16' \\(its runs: 'fp32'\\)"):
        check_earlier_runs(out, now, resume=True, overwrite=False)
    config.write_text(json.dumps({"run": {"precision": "bf16"}, "resolved": {"precision": "bf16"}}))
    assert check_earlier_runs(out, now, resume=True, overwrite=False)["eurosat"]["run.precision"] == "bf16"


def test_run_vtab_refuses_no_tasks_or_paths_for_tasks_before_writing_anything(tasks, tmp_path):
    """No tasks ended in an IndexError, a task's path for its Task in an AttributeError, a string
    --examples in a TypeError, a string grid in float's ValueError; named now, before the output
    folder is made."""
    from vitlab.config import ConfigError
    from vitlab.configs import load_recipe
    from vitlab.train.vtab import run_vtab

    cfg, out = load_recipe("vtab1k"), tmp_path / "vtab"
    for given, extra, message in (([], {}, r"^tasks=\[\]: expected one or more vitlab.eval.vtab.Task"),
                                  ([str(tasks / "EuroSAT")], {}, r"^tasks=\['.*EuroSAT'\]: expected one or more"),
                                  (find_tasks(tasks), {"examples": "20"}, r"^examples='20': expected an integer"),
                                  # float's "could not convert string to float: '.'", once the views were written
                                  (find_tasks(tasks), {"grid": "0.01"}, r"^grid='0.01': expected positive"),
                                  # taken as true: the finished runs were read back
                                  (find_tasks(tasks), {"resume": "no"}, r"^resume='no': must be True or False")):
        with pytest.raises(ConfigError, match=message):
            run_vtab(cfg, given, out, **extra)
    assert not out.exists()


def test_resume_refuses_runs_made_before_the_tasks_images_changed(tiny_checkpoint, tmp_path, capsys):
    """Images added to a task's train/ re-cut its split: --resume read the runs made on the earlier
    cut back and scored them on validation images some of them had trained on."""
    root = tmp_path / "tasks"
    image_folder(root / "EuroSAT" / "train", 10, 2)
    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, root, out, steps=1), "--grid", "0.01"]
    assert main(args) == 0 and main([*args, "--resume"]) == 0  # unchanged: kept
    capsys.readouterr()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(root / "EuroSAT" / "train" / "a" / "new.png")
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--resume: the runs of eurosat in" in err and "were made with other settings: task images=" in err, err


def test_a_class_subset_is_refused_before_any_run(tasks, tiny_checkpoint, tmp_path, capsys):
    """The runs trained on the subset's classes and were scored on the task's views of all of them:
    the first run trained, then scoring ended on a label beyond its head (and a subset in another
    order would have been scored on labels that named other classes)."""
    from vitlab.config import ConfigError
    from vitlab.train.vtab import run_vtab

    out = tmp_path / "vtab"
    assert main([*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat",
                 "--set", "data.class_subset=b,a"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitlab vtab: error: data.class_subset=('b', 'a'): a VTAB task is trained and scored on all of its classes; "
        "for fewer, make a task folder of those classes")
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"^cfg='vtab1k': expected a TrainConfig"):
        run_vtab("vtab1k", find_tasks(tasks), out)


def test_a_stopped_run_goes_on_from_its_checkpoint_with_resume(tasks, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """Stopped after its checkpoint of step 4 of 6, a run was started afresh by --resume (run.ckpt_every
    was set to 0 for every run and its folder's checkpoints deleted): now it trains its last 2 steps, to
    the weights of a run never stopped; without --resume or --overwrite its folder is refused."""
    from vitlab.train import loop
    from vitlab.weights import load_model

    def vtab(out):
        return [*tiny_vtab(tiny_checkpoint, tasks, out, steps=6), "--only", "eurosat", "--grid", "0.01",
                "--set", "run.ckpt_every=2", "--set", "run.keep_ckpts=1"]

    assert main(vtab(tmp_path / "whole")) == 0
    # a finished run keeps its weights, not its checkpoints (the optimiser's state beside the weights)
    assert not list((tmp_path / "whole").glob("*/*/checkpoints"))
    assert (tmp_path / "whole" / "eurosat" / "final_lr_0.01" / "model.safetensors").is_file()
    save = loop.save_checkpoint

    def stop_after_step_4(setup, state, ckpt_dir, step):
        saved = save(setup, state, ckpt_dir, step)
        if step == 4:
            raise KeyboardInterrupt
        return saved

    out = tmp_path / "vtab"
    monkeypatch.setattr(loop, "save_checkpoint", stop_after_step_4)
    assert main(vtab(out)) == 130
    monkeypatch.setattr(loop, "save_checkpoint", save)
    capsys.readouterr()
    assert main(vtab(out)) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab vtab: error: --out={str(out)!r} holds 1 run(s) of these tasks that stopped before their end "
        "(eurosat/final_lr_0.01, ...); continue them with --resume, start them afresh with --overwrite, or choose "
        "another --out")
    steps = []
    step = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: steps.append(1) or step(*a, **k))
    assert main([*vtab(out), "--resume"]) == 0
    assert len(steps) == 2 and not (out / "eurosat" / "final_lr_0.01" / "checkpoints").exists()
    resumed, whole = (load_model(str(o / "eurosat" / "final_lr_0.01" / "model.safetensors")).state_dict()
                      for o in (out, tmp_path / "whole"))
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_diverging_rate_loses_and_the_protocol_goes_on(tasks, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A rate whose run stopped on a non-finite loss stopped the whole protocol, every task after it
    unrun; now it loses (null in the report, 'diverged' in the table), and a task on which every rate
    diverges is one line."""
    import vitlab.train.vtab as vtab
    from vitlab.train.numerics import NonFiniteError
    from vitlab.train.vtab import chosen_lrs

    # the tiny fine-tune at 1e30 overflows or not by the head's first steps (a zero head moves alone at
    # first, and the clipped step can leave its loss finite): the run's own stop is train's, made certain here
    real_train = vtab.train

    def train(cfg, **kwargs):
        if cfg.optim.lr >= 1e29:
            raise NonFiniteError("step 2: the training loss is not finite")
        return real_train(cfg, **kwargs)

    monkeypatch.setattr(vtab, "train", train)

    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=3), "--only", "eurosat"]
    assert main([*args, "--grid", "0.01,1e30"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed.strip().splitlines()[-1])["tasks"]["eurosat"]
    assert report["val_top1"]["1e+30"] is None and report["val_top1"]["0.01"] is not None and report["lr"] == 0.01
    assert "1e+30: diverged" in printed
    assert main([*args, "--grid", "1e30,1e31", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitlab vtab: error: eurosat: every learning rate of the grid diverged (1e+30, 1e+31)")
    assert len(err.splitlines()) == 1
    # shared: a rate that diverged on one task is not the one for all
    val = {"a": {"0.01": 0.5, "0.03": None}, "b": {"0.01": 0.25, "0.03": 1.0}}
    assert chosen_lrs((0.01, 0.03), val, "shared") == {"a": 0.01, "b": 0.01}
    assert chosen_lrs((0.01, 0.03), val, "per-task") == {"a": 0.01, "b": 0.03}


def test_a_rate_that_diverged_is_not_trained_again_on_resume(tasks, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """vtab --resume trained a rate whose run had diverged again, to the same end (as sweep --resume did);
    its record (the sweep's, shared) keeps it lost, unless its config changed."""
    import vitlab.train.vtab as vtab
    from vitlab.train.numerics import NonFiniteError

    trained = []
    real_train = vtab.train

    def train(cfg, **kwargs):
        trained.append(f"{cfg.optim.lr:g}")
        if cfg.optim.lr >= 1e29:  # made certain, as in the test above
            raise NonFiniteError("step 2: the training loss is not finite")
        return real_train(cfg, **kwargs)

    monkeypatch.setattr(vtab, "train", train)
    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat", "--grid", "0.01,1e30"]
    assert main(args) == 0
    record = out / "eurosat" / "lr_1e+30" / "diverged.json"
    assert trained == ["0.01", "1e+30", "0.01"] and record.is_file()
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]["eurosat"]
    trained.clear()
    assert main([*args, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert trained == []  # the finished runs read back, the diverged rate counted lost untrained
    assert "1e+30: diverged" in printed
    assert json.loads(printed.strip().splitlines()[-1])["tasks"]["eurosat"]["val_top1"] == first["val_top1"]
    # a setting changed: trained again (the finished runs read back), its record of the new config
    skipping = ["--set", "run.on_nonfinite=skip", "--set", "run.max_skipped_steps=0"]
    assert main([*args, "--resume", *skipping]) == 0
    assert trained == ["1e+30"] and json.loads(record.read_text())["config"]["run"]["on_nonfinite"] == "skip"


def test_a_final_run_that_diverged_is_not_trained_again_on_resume(tasks, tiny_checkpoint, tmp_path, capsys,
                                                                  monkeypatch):
    """A task's final run kept no record of its divergence as the grid's rates do: vtab --resume trained it
    again, from its last checkpoint or from scratch, to the same end.  It stops the protocol naming the task,
    and --resume stops on its record untrained, unless its config changed."""
    import vitlab.train.vtab as vtab
    from vitlab.train.numerics import NonFiniteError

    trained = []
    real_train = vtab.train

    def train(cfg, **kwargs):
        trained.append(Path(cfg.run.out).name)
        if Path(cfg.run.out).name.startswith("final") and cfg.run.on_nonfinite == "stop":  # made certain
            raise NonFiniteError("step 1: the training loss is not finite")
        return real_train(cfg, **kwargs)

    monkeypatch.setattr(vtab, "train", train)
    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat", "--grid", "0.01"]
    line = ("vitlab vtab: error: eurosat: the final run at lr 0.01 diverged, so the task has no test score: step 1: "
            "the training loss is not finite")
    assert main(args) == 2
    record = out / "eurosat" / "final_lr_0.01" / "diverged.json"
    assert trained == ["final_lr_0.01"] and record.is_file() and capsys.readouterr().err.strip() == line
    trained.clear()
    assert main([*args, "--resume"]) == 2
    assert trained == [] and capsys.readouterr().err.strip() == line
    # a setting changed: trained, and the record goes
    assert main([*args, "--resume", "--set", "run.on_nonfinite=skip"]) == 0
    assert trained == ["final_lr_0.01"] and not record.exists()


def test_a_field_every_run_sets_is_refused_and_a_cache_folder_is_kept(tasks, tiny_checkpoint, tmp_path, capsys):
    """--set optim.lr=0.5 trained the grid's rates, --set data.train_examples=500 the --examples, --set
    run.out the runs under --out, all without a word; --set data.cache_dir was replaced by OUT/cache."""
    out = tmp_path / "vtab"
    args = [*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat"]
    for given, line in (("optim.lr=0.5", "optim.lr: each run's rate is one of the grid's (--grid; one rate: "
                                         "--grid 0.01)"),
                        ("data.train_examples=500", "data.train_examples: each task's examples are --examples"),
                        ("run.out=elsewhere", "run.out: each run's folder is under --out")):
        assert main([*args, "--set", given]) == 2
        assert capsys.readouterr().err.strip() == f"vitlab vtab: error: --set {line}; leave it out"
    assert not out.exists()
    # with no grid at all, optim.lr is the one rate
    assert main([*args[:args.index("--grid")], *args[args.index("--grid") + 2:], "--set", "optim.lr_grid=()",
                 "--set", "optim.lr=0.02", "--set", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["protocol"]["grid"] == [0.02]
    assert (tmp_path / "cache").is_dir() and not (out / "cache").exists()


def test_vtab_removes_the_temporaries_of_its_records_that_a_kill_left_and_no_other_file(tasks, tiny_checkpoint,
                                                                                        tmp_path, caplog):
    """vtab killed outright while it replaced vtab.json or settings.json (``atomic_write``) leaves the write's
    hidden temporary file in --out: a run's own records' were removed as it started, the protocol's stayed."""
    import logging

    from vitlab.files import new_temporary

    out = tmp_path / "vtab"
    out.mkdir()
    left = []
    for name in ("vtab.json", "settings.json", "notes.txt"):  # the writer's own, of its records and of another
        fd, tmp = new_temporary(out / name)
        os.close(fd)
        left.append(os.path.basename(tmp))
    with caplog.at_level(logging.WARNING, logger="vitlab.train.vtab"):
        assert main([*tiny_vtab(tiny_checkpoint, tasks, out, steps=1), "--only", "eurosat", "--grid", "0.01"]) == 0
    assert sorted(n for n in os.listdir(out) if n.endswith(".tmp")) == [left[2]]
    assert all(str(out / name) in caplog.text for name in left[:2])
