"""The loop's guarantees: accumulation equals a big batch, resume is bit-exact."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from vitlab.train import train
from vitlab.train.checkpoint import list_checkpoints, load_checkpoint
from vitlab.train.metrics import read_jsonl
from vitlab.weights import load_model

# a step's and an evaluation's seconds on a time-limited run's clock (``run_clock``): binary
# fractions, so that the clock's sums are exact
STEP_S, EVAL_S = 2 ** -6, 2 ** -4


def weights(summary) -> dict:
    return load_model(summary["weights"]).state_dict()


def test_accumulation_equals_one_big_batch(tiny):
    # no dropout, no augmentation, fp32: K micro-batches of b must give the update of one batch K*b.
    # SGD, not Adam: Adam divides by sqrt(v), which turns rounding noise in gradients that are
    # zero in exact arithmetic (the key bias: softmax ignores it) into updates of size lr.
    sgd = dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.0, steps=4, batch_size=32)
    one = train(tiny("one", accum_steps=1, **sgd), verbose=False)
    four = train(tiny("four", accum_steps=4, **sgd), verbose=False)
    a, b = weights(one), weights(four)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    assert one["train_loss"] == __import__("pytest").approx(four["train_loss"], rel=1e-5)


@pytest.mark.parametrize("augment_batches", [1, 3])  # 3: the restart at step 4 falls inside a group
def test_resume_is_bit_exact(tiny, augment_batches):
    # dropout, augmentation and EMA all consume or carry state that must survive a restart
    cfg = tiny("run", steps=8, ckpt_every=4, keep_ckpts=3, crop="pad", crop_pad=2, flip=True, ema_decay=0.9,
               model_overrides={"img_size": 8, "patch_size": 4, "width": 16, "depth": 1, "num_heads": 2,
                                "mlp_dim": 32, "dropout": 0.1}, **{"data.augment_batches": augment_batches})
    full = train(cfg, verbose=False)
    logged = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    ckpts = list_checkpoints(f"{cfg.run.out}/checkpoints")
    assert [p.name for p in ckpts] == ["ckpt-00000004.pt", "ckpt-00000008.pt"]
    uninterrupted = load_checkpoint(ckpts[-1])
    shutil.move(str(ckpts[-1]), str(ckpts[-1]) + ".bak")  # as if the run died after step 4
    resumed = train(cfg, resume=True, verbose=False)
    again = load_checkpoint(ckpts[-1])
    assert resumed["steps"] == full["steps"] == 8
    for part in ("model",):
        for k, v in uninterrupted[part].items():
            assert torch.equal(v, again[part][k]), k
    for k, v in uninterrupted["ema"]["module"].items():
        assert torch.equal(v, again["ema"]["module"][k]), k
    s1, s2 = uninterrupted["optimizer"]["state"], again["optimizer"]["state"]
    for i in s1:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s1[i][name], s2[i][name])
    assert uninterrupted["stream"] == again["stream"]
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the metrics files list each step once (the killed run had logged steps 6 and 8 too)
    relogged = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    assert [r["step"] for r in relogged] == [r["step"] for r in logged] == [2, 4, 6, 8]
    assert [r["loss"] for r in relogged] == [r["loss"] for r in logged]


def test_a_run_resumed_between_two_records_logs_what_the_uninterrupted_run_logged(tiny):
    # the checkpoint of step 5 falls inside the record of steps 5-6: the resumed run's record of
    # step 6 gave step 6's loss and accuracy alone, and the summary's train_loss with it
    cfg = tiny("run", steps=6, ckpt_every=5, keep_ckpts=2, log_every=2)
    full = train(cfg, verbose=False)
    logged = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    list_checkpoints(f"{cfg.run.out}/checkpoints")[-1].unlink()  # as if the run died after step 5
    resumed = train(cfg, resume=True, verbose=False)
    relogged = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    fields = ("step", "lr", "loss", "train_top1", "grad_norm", "skipped_steps")
    assert [[r[f] for f in fields] for r in relogged] == [[r[f] for f in fields] for r in logged]
    assert [r["step"] for r in relogged] == [2, 4, 6]
    assert resumed["train_loss"] == full["train_loss"]


def test_a_written_checkpoints_state_is_let_go_before_the_next_steps_and_the_final_weights(tiny, monkeypatch):
    """Under FSDP rank 0's checkpoint state is a gathered copy of the whole model and optimiser state
    (three times the weights with Adam): the loop held each until the next was made (two copies at once),
    and the last one beside the final weights' unsharded copy, clone and serialisations (rank 0 of a
    19M-parameter run peaked at 0.93 GB where it needs 0.74, tests/train/test_memory_estimate.py)."""
    import weakref

    import vitlab.train.loop as loop

    made, alive = [], []
    training_state, final_model = loop.training_state, loop.final_model

    def watched(*args, **kwargs):
        state = training_state(*args, **kwargs)
        alive.append([ref() is not None for ref in made])  # the earlier checkpoints' states, as this one is made
        made.append(weakref.ref(state["rng"]["torch"]))  # a tensor of the state's own, which nothing else holds
        return state

    def at_the_end(setup):
        alive.append([ref() is not None for ref in made])
        return final_model(setup)

    monkeypatch.setattr(loop, "training_state", watched)
    monkeypatch.setattr(loop, "final_model", at_the_end)
    train(tiny("run", steps=4, ckpt_every=2, tensorboard=False), verbose=False)
    assert alive == [[], [False], [False, False]]


def test_img_per_s_counts_the_steps_not_the_evaluations_and_checkpoints_between_them(tiny, run_clock, monkeypatch):
    # evaluations and checkpoints made to take 1000 s each on the loop's clock, its steps 1/64 s: a record's
    # img_per_s divided its window's images by the evaluation's (and the previous checkpoint's) time too
    import vitlab.train.loop as loop

    clock = run_clock(step_s=STEP_S, eval_s=1000.0)
    save = loop.save_checkpoint

    def taking_1000_s(*args, **kwargs):
        result = save(*args, **kwargs)
        clock.now += 1000.0
        return result

    monkeypatch.setattr(loop, "save_checkpoint", taking_1000_s)
    cfg = tiny("rate", steps=8, log_every=2, eval_every=4, ckpt_every=2, batch_size=32)
    train(cfg, verbose=False)
    records = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8] and "val_top1" in records[1]
    assert clock.now == 8 * STEP_S + 6000.0  # 2 evaluations (at 4, and at 8 the final one), 4 checkpoints
    # each record's two steps of 32 images, in their 2/64 s
    assert [r["img_per_s"] for r in records] == [2 * 32 / (2 * STEP_S)] * 4


def test_a_finished_run_is_kept_unless_resumed_or_overwritten(tiny):
    import pytest

    from vitlab.config import ConfigError

    cfg = tiny("run", steps=3)
    first = train(cfg, verbose=False)
    saved = weights(first)
    with pytest.raises(ConfigError, match="--resume.*--overwrite"):
        train(cfg, verbose=False)
    assert all(torch.equal(v, weights(first)[k]) for k, v in saved.items())  # nothing was touched
    again = train(cfg, resume=True, verbose=False)  # resuming a finished run re-reports it
    assert again["steps"] == 3 and again["val_top1"] == first["val_top1"]
    fresh = train(tiny("run", steps=2), overwrite=True, verbose=False)
    assert fresh["steps"] == 2
    assert [p.name for p in list_checkpoints(f"{cfg.run.out}/checkpoints")] == ["ckpt-00000002.pt"]
    assert [r["step"] for r in read_jsonl(f"{cfg.run.out}/metrics.jsonl")] == [2]


def _pngs(folder: Path, seed: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(2):
        (folder / f"c{c}").mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"c{c}" / f"{i}.png")
    return folder


def test_a_run_on_a_relative_data_path_is_scored_and_resumed_on_it_from_another_folder(tiny, tmp_path, monkeypatch):
    """A run's data named relative to the folder it was trained in was recorded as typed and read
    relative to the folder a later command ran in: eval from another folder holding data of the same
    name scored that data as the run's split, given the run's data by its absolute path it scored the
    whole set (the run's training images too), and --resume there trained on the other data."""
    from vitlab.config import ConfigError
    from vitlab.data.labelled import load_held_out
    from vitlab.experiments.common import finished_run
    from vitlab.train.config import from_dict
    from vitlab.train.legacy import recorded_section
    from vitlab.train.loop import check_own_folder
    from vitlab.train.overrides import with_changes
    from vitlab.train.state import check_same_run

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    data, other = _pngs(work / "d", 0), _pngs(elsewhere / "d", 1)  # the same name and classes, other images
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(work)
    cfg = tiny("run", data="d", val_split=6, batch_size=9, steps=2, cache_dir=None)
    train(cfg, verbose=False)
    recorded = json.loads((Path(cfg.run.out) / "config.json").read_text())
    assert recorded["data"]["source"] == str(data)
    run = recorded_section(recorded, "data")
    there = load_held_out(run, 8)
    monkeypatch.chdir(elsewhere)
    for source in (None, str(data)):
        scored = load_held_out(run, 8, source=source)
        assert scored.split == 6 and torch.equal(scored.images[scored.held], there.images[there.held])
    with pytest.raises(ConfigError, match=r"data.source=.*elsewhere/d.*checkpoint: .*work/d"):
        train(with_changes(cfg, {"data.source": "d"}), resume=True, verbose=False)  # other data: refused
    assert train(with_changes(cfg, {"data.source": str(data)}), resume=True, verbose=False)["steps"] == 2
    # a checkpoint of a run that recorded its data as typed resumes from the folder it was typed in, and
    # the data as typed there is the run's: to an experiment's finished run, to the demo's own folder
    monkeypatch.chdir(work)
    check_same_run(from_dict(recorded), {**recorded, "data": {**recorded["data"], "source": "./d"}})
    assert finished_run(cfg)["steps"] == 2
    (Path(cfg.run.out) / "config.json").write_text(json.dumps({**recorded, "data": {**recorded["data"],
                                                                                   "source": "./d"}}))
    assert finished_run(cfg)["steps"] == 2
    check_own_folder(with_changes(cfg, {"data.source": "./d"}))
    with pytest.raises(ConfigError, match="holds the checkpoints of a 'test' run on"):
        check_own_folder(with_changes(cfg, {"data.source": str(other)}))


def test_a_finished_run_is_found_from_another_folder_by_its_summarys_weights(tiny, tmp_path, monkeypatch):
    """summary.json recorded its weights relative to the folder the command ran in: an experiment run again
    from another folder took its finished runs for none (no such weights file there) and trained them
    again.  A summary records its files absolute now, and one written before is read in its run's folder."""
    from vitlab.experiments.common import finished_run
    from vitlab.train.overrides import with_changes

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = with_changes(tiny("run", steps=2, tensorboard=False), {"run.out": "runs/x"})
    summary = train(cfg, verbose=False)
    folder = work / "runs" / "x"
    assert summary["weights"] == str(folder / "model.safetensors")
    assert summary["classes"] == str(folder / "classes.json")
    monkeypatch.chdir(tmp_path)
    elsewhere = with_changes(cfg, {"run.out": "work/runs/x"})  # the same folder, spelt from here
    assert finished_run(elsewhere)["weights"] == str(folder / "model.safetensors")
    # a summary of before: its files relative to work/, where its command ran
    written = json.loads((folder / "summary.json").read_text())
    old = {**written, "weights": "runs/x/model.safetensors", "classes": "runs/x/classes.json"}
    (folder / "summary.json").write_text(json.dumps(old))
    found = finished_run(elsewhere)
    assert found["steps"] == 2 and found["weights"] == str(folder / "model.safetensors")
    assert found["classes"] == str(folder / "classes.json")


def test_resume_of_a_fine_tune_whose_init_is_gone_says_the_init_is_needed(tiny, tmp_path):
    """--resume of a fine-tune whose init file had been deleted was refused as "no such file or folder",
    which read as a mistake (the checkpoint holds the weights): the model is built as the init's before the
    checkpoint is loaded, and the refusal now says so."""
    import vitlab
    from vitlab.config import ConfigError
    from vitlab.train.overrides import with_changes

    init = tmp_path / "w.safetensors"
    vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=8, patch_size=4, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10), init)
    cfg = with_changes(tiny("run", steps=2, ckpt_every=1, tensorboard=False),
                       {"model.init": str(init), "model.overrides": {}})
    train(cfg, verbose=False)
    init.unlink()
    with pytest.raises(ConfigError, match=rf"^model.init='{re.escape(str(init))}': no such file or folder; --resume "
                                          r"of the run whose checkpoints run.out holds needs its init all the same: "
                                          r"the model is built from the init .* put the init back at this path$"):
        train(cfg, resume=True, verbose=False)
    shutil.rmtree(tmp_path / "run")  # no run's checkpoints: the refusal as it was
    with pytest.raises(ConfigError, match=rf"^model.init='{re.escape(str(init))}': no such file or folder$"):
        train(cfg, verbose=False)


def test_a_fine_tune_removes_the_init_s_pre_logits_whatever_its_class_count(tiny, tmp_path):
    """The paper's fine-tune removes the whole head, both layers (Sec. 3.2), and so did vitlab's for data of
    another class count; an init of as many classes as the data (10 digits from a 10-class run with a pre-logits
    layer) kept its pre-logits layer, model.keep_pre_logits=false accepted and ignored."""
    import vitlab
    from vitlab.train.build import make_model
    from vitlab.train.overrides import with_changes

    init = tmp_path / "w.safetensors"
    vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=8, patch_size=4, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10, representation_size=12), init)
    cfg = with_changes(tiny("run"), {"model.init": str(init), "model.overrides": {}})
    for classes in (10, 3):
        model = make_model(cfg, classes, (8, 8))
        assert model.pre_logits is None and model.cfg.representation_size is None
        assert model.head.weight.shape == (classes, 16) and not model.head.weight.any() and not model.head.bias.any()
    kept = make_model(with_changes(cfg, {"model.keep_pre_logits": True}), 10, (8, 8))
    assert kept.cfg.representation_size == 12 and kept.head.weight.shape == (10, 12) and not kept.head.weight.any()
    assert torch.equal(kept.pre_logits.fc.weight, load_model(init).pre_logits.fc.weight)


def test_a_fine_tune_that_holds_out_images_its_init_trained_on_says_so(tiny):
    """A fine-tune on the data its init's run trained on (masked patch prediction's pre-training, then the labels)
    scored its held-out images without a word where its init had trained on them: the mpp recipe holds out 1%,
    and vitlab finetune's own recipe 2% of CIFAR, half of it images MPP trained on.  It warns, naming how many."""
    import warnings

    from vitlab.train.overrides import with_changes

    pre = train(with_changes(tiny("mpp", steps=1), {"model.mpp": "color"}), verbose=False)  # holds out 100
    for held, trained_on in ((150, 50), (100, 0), (60, 0)):  # a smaller hold-out of the same seed is part of it
        cfg = with_changes(tiny(f"ft{held}", steps=1), {"model.init": pre["weights"], "model.overrides": {},
                                                         "data.val_split": held})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(cfg, verbose=False)
        said = [str(w.message) for w in caught if "never saw" in str(w.message)]
        assert said == ([f"model.init={pre['weights']!r}: its run trained on {trained_on} of the {held} images this "
                         "run holds out (data.val_split), so they are not images it never saw; its run held out "
                         "data.val_split=100 of data.split_seed=0"] if trained_on else []), (held, said)
    # another seed's split of the same data
    with pytest.warns(UserWarning, match=r"its run trained on \d+ of the 100 images this run holds out"):
        train(with_changes(tiny("seed1", steps=1), {"model.init": pre["weights"], "model.overrides": {},
                                                    "data.split_seed": 1}), verbose=False)


def test_keep_pre_logits_is_refused_for_an_init_without_them(tiny, tmp_path):
    """model.keep_pre_logits=true with weights that have no pre-logits layer was accepted, and the run trained a
    one-layer head as without it, saying nothing."""
    import vitlab
    from vitlab.config import ConfigError
    from vitlab.train.overrides import with_changes

    init = tmp_path / "w.safetensors"
    vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=8, patch_size=4, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10), init)
    cfg = with_changes(tiny("run"), {"model.init": str(init), "model.overrides": {}, "model.keep_pre_logits": True})
    with pytest.raises(ConfigError, match=rf"^model.keep_pre_logits=True: model.init='{re.escape(str(init))}' has "
                                          r"no pre-logits layer to keep; leave it false$"):
        train(cfg, verbose=False)
    assert not (tmp_path / "run").exists()


def test_a_fine_tune_of_a_relative_init_is_resumed_from_another_folder(tiny, tmp_path, monkeypatch):
    """A fine-tune's model.init named relative to the folder it was trained in was recorded as typed:
    from another folder, --resume with the init spelt from there was refused as another init, and
    spelt as recorded it was no file; the run could be resumed from its own folder only."""
    import vitlab
    from vitlab.config import ConfigError
    from vitlab.experiments.common import finished_run
    from vitlab.train.config import from_dict
    from vitlab.train.overrides import with_changes
    from vitlab.train.state import check_same_run

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    for folder, seed in ((work, 0), (elsewhere, 1)):  # an init of the same name and model in each
        folder.mkdir()
        torch.manual_seed(seed)
        vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=8, patch_size=4, width=16, depth=1, num_heads=2,
                                              mlp_dim=32, num_classes=10), folder / "w.safetensors")
    monkeypatch.chdir(work)
    cfg = with_changes(tiny("run", steps=2, ckpt_every=1), {"model.init": "w.safetensors", "model.overrides": {}})
    train(cfg, verbose=False)
    recorded = json.loads((Path(cfg.run.out) / "config.json").read_text())
    assert recorded["model"]["init"] == str(work / "w.safetensors")
    assert finished_run(cfg)["steps"] == 2  # an experiment's run, asked as typed, is the one recorded
    monkeypatch.chdir(tmp_path)
    resumed = train(with_changes(cfg, {"model.init": "work/w.safetensors"}), resume=True, verbose=False)
    assert resumed["steps"] == 2
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError, match=r"model.init=.*elsewhere/w.safetensors.*checkpoint: .*work/w.safetensors"):
        train(cfg, resume=True, verbose=False)  # the init of that name here is another file: refused
    # a checkpoint that recorded its init as typed resumes from the folder it was typed in
    monkeypatch.chdir(work)
    check_same_run(from_dict(recorded), {**recorded, "model": {**recorded["model"], "init": "./w.safetensors"}})


def test_a_fine_tune_records_its_inits_model_not_the_recipes(tiny, tmp_path):
    """A fine-tune of an init with no registry name (a ViTConfig of its own) recorded the recipe's model
    as its model: config.json's model.name and summary.json's "model" said ViT-Ti/16, and its
    model.overrides the recipe's architecture (width 16, 'ViT-tiny/4'), a model that was not trained.
    The model section is the init's model as trained: its name (None: it has none), and of the
    overrides the regularisation the fine-tune applies."""
    import vitlab
    from vitlab.experiments.common import finished_run
    from vitlab.models.vit import ViTConfig
    from vitlab.train.config import from_dict
    from vitlab.train.overrides import with_changes
    from vitlab.train.state import check_same_run

    nameless, named = tmp_path / "nameless.safetensors", tmp_path / "named.safetensors"
    vitlab.save_model(vitlab.create_model(ViTConfig(img_size=8, patch_size=4, width=24, depth=1, num_heads=2,
                                                    mlp_dim=32, num_classes=10)), nameless)
    vitlab.save_model(vitlab.create_model("ViT-S/16", img_size=8, patch_size=4, width=24, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10), named)
    for init, name in ((nameless, None), (named, "ViT-S/16")):
        cfg = with_changes(tiny(init.stem, steps=2, ckpt_every=1), {"model.init": str(init), "model.drop_path": 0.1})
        summary = train(cfg, verbose=False)
        saved = json.loads((Path(cfg.run.out) / "config.json").read_text())
        recorded = saved["model"]
        assert (summary["model"], recorded["name"], recorded["overrides"]) == (name, name, {"drop_path": 0.1})
        assert load_model(summary["weights"]).cfg.width == 24
        assert finished_run(cfg)["steps"] == 2  # an experiment's run, asked with the recipe's model, is this one
        assert train(cfg, resume=True, verbose=False)["model"] == name
    # a checkpoint that recorded the recipe's model and its architecture overrides still resumes
    earlier = {**recorded, "name": "ViT-Ti/16", "overrides": {**cfg.model.overrides, "drop_path": 0.1}}
    check_same_run(from_dict(saved), {**saved, "model": earlier})


def test_a_run_started_afresh_leaves_no_earlier_results_beside_its_config(tiny, monkeypatch):
    """--overwrite deleted the earlier run's checkpoints and wrote its config.json and classes.json anew,
    but left its summary and weights until the new run's end: interrupted, the folder held the earlier
    run's results as the new config's, which an experiment took for its finished run."""
    from vitlab.experiments.common import finished_run
    from vitlab.train import loop
    from vitlab.train.overrides import with_changes

    first = tiny("run", steps=2)
    train(first, verbose=False)
    out = Path(first.run.out)
    assert {"summary.json", "model.safetensors", "curves.png"} <= {p.name for p in out.iterdir()}
    second = with_changes(first, {"optim.steps": 4})

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(second, verbose=False, overwrite=True)
    assert json.loads((out / "config.json").read_text())["optim"]["steps"] == 4
    assert finished_run(second) is None
    assert sorted(p.name for p in out.iterdir()) == ["classes.json", "config.json", "metrics.csv", "metrics.jsonl"]


@pytest.mark.parametrize("name", ["config.json", "classes.json", "metrics.jsonl", "metrics.csv", "summary.json"])
def test_a_full_disk_while_a_finished_run_is_resumed_keeps_its_records(tiny, monkeypatch, name):
    """A resumed run writes its config.json, classes.json and logs again as it starts and its summary.json
    as it ends: written in place, a full disk left the finished run's file truncated, and the run was taken
    for none (an experiment's ``finished_run`` trained it again; vtab --resume stopped at the summary's
    JSON), or its logged curves cut short (the report drew what was left)."""
    from helpers.full_disk import fill_disk_at

    from vitlab.experiments.common import finished_run

    cfg = tiny("run", steps=2, ckpt_every=2)
    train(cfg, verbose=False)
    out = Path(cfg.run.out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    fill_disk_at(monkeypatch, name)
    with pytest.raises(OSError, match="No space left"):
        train(cfg, resume=True, verbose=False)
    monkeypatch.undo()
    assert (out / name).read_bytes() == before[name]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(before)  # no temporary file left
    assert finished_run(cfg) is not None


@pytest.mark.parametrize("flag", ["resume", "overwrite", "verbose"])
def test_train_refuses_a_flag_that_is_not_true_or_false_before_any_work(tiny, flag):
    # a string from a config file or argv: "no" is truthy, so overwrite="no" deleted the earlier
    # run's checkpoints and started afresh, and resume="no" continued it
    from vitlab.config import ConfigError

    cfg = tiny("run", steps=3)
    train(cfg, verbose=False)
    held = {p: p.stat().st_mtime_ns for p in [*list_checkpoints(f"{cfg.run.out}/checkpoints"),
                                               Path(cfg.run.out) / "model.safetensors"]}
    with pytest.raises(ConfigError, match=rf"^{flag}='no': must be True or False"):
        train(cfg, **{"verbose": False, flag: "no"})
    assert {p: p.stat().st_mtime_ns for p in held if p.exists()} == held  # nothing written or deleted
    with pytest.raises(ConfigError, match=r"^started_at='0': expected None or a time.monotonic\(\) reading"):
        train(cfg, verbose=False, resume=True, started_at="0")


def test_a_batch_larger_than_the_training_split_is_refused_however_it_is_accumulated(tiny):
    """A batch of 32 from 30 training examples was refused in one micro-batch and trained in 4 of 8, each step
    drawing its micro-batches across epochs (examples twice in one batch): whether the run was accepted
    depended on the accumulation, which optim.accum_steps=auto sets by the device's memory."""
    from vitlab.config import ConfigError

    for accum in (1, 4):
        with pytest.raises(ConfigError, match=r"^optim.batch_size=32: the training split has only 30 examples, "
                                              r"fewer than one batch"):
            train(tiny(f"run{accum}", batch_size=32, accum_steps=accum, train_examples=130, steps=1), verbose=False)


def test_resume_refuses_a_changed_data_order(tiny):
    import pytest

    from vitlab.config import ConfigError

    train(tiny("run", steps=2), verbose=False)
    with pytest.raises(ConfigError, match="batch_size=16"):
        train(tiny("run", steps=4, batch_size=16), resume=True, verbose=False)


def test_resume_refuses_another_validation_set(tiny, tmp_path, monkeypatch):
    """Another data.val_data on --resume was taken without a word: the rest of the run was scored on
    other images, and its curves mixed two validation sets' numbers under one name."""
    from vitlab.config import ConfigError
    from vitlab.train.overrides import with_changes

    data, first, other = _pngs(tmp_path / "d", 0), _pngs(tmp_path / "a", 1), _pngs(tmp_path / "b", 2)
    monkeypatch.chdir(tmp_path)
    cfg = with_changes(tiny("run", steps=2, batch_size=8, cache_dir=str(tmp_path / "cache")),
                       {"data.source": str(data), "data.val_data": str(first)})
    train(cfg, verbose=False)
    with pytest.raises(ConfigError, match=rf"^--resume: data.val_data='{re.escape(str(other))}' \(checkpoint: "
                                          rf"'{re.escape(str(first))}'\) differ from the checkpoint's run"):
        train(with_changes(cfg, {"data.val_data": str(other)}), resume=True, verbose=False)
    with pytest.raises(ConfigError, match=r"^--resume: data.val_data=None \(checkpoint: "):
        train(with_changes(cfg, {"data.val_data": None}), resume=True, verbose=False)
    # the same set spelt another way is the run's
    assert train(with_changes(cfg, {"data.val_data": "./a"}), resume=True, verbose=False)["steps"] == 2


def test_resume_refuses_another_head_or_objective(tiny, tmp_path):
    """--resume with model.pre_logits, model.keep_pre_logits or model.mpp changed built another model than the
    checkpoint's, and its weights failed to load into it in a RuntimeError's traceback (missing keys, a head of
    another shape)."""
    import vitlab
    from vitlab.config import ConfigError
    from vitlab.train.overrides import with_changes

    cfg = tiny("run", steps=2, ckpt_every=1)
    train(cfg, verbose=False)
    for change in ({"model.pre_logits": True}, {"model.mpp": "color"}):
        name, value = next(iter(change.items()))
        with pytest.raises(ConfigError, match=rf"^--resume: {re.escape(name)}={value!r} \(checkpoint: "
                                              r"(False|None)\) differ from the checkpoint's run"):
            train(with_changes(cfg, change), resume=True, verbose=False)
    init = tmp_path / "w.safetensors"
    vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=8, patch_size=4, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10, representation_size=12), init)
    tuned = with_changes(tiny("tuned", steps=2, ckpt_every=1), {"model.init": str(init), "model.overrides": {}})
    train(tuned, verbose=False)
    with pytest.raises(ConfigError, match=r"^--resume: model.keep_pre_logits=True \(checkpoint: False\) differ"):
        train(with_changes(tuned, {"model.keep_pre_logits": True}), resume=True, verbose=False)


def test_resume_refuses_a_data_folder_whose_classes_changed_and_keeps_the_runs_records(tiny, tmp_path):
    """A class folder renamed since (another class in place of one) was resumed without a word: a label is a
    class's place in the list, so every image of the classes after it trained the head's output of another
    class, and classes.json was written over with the new names beside the old outputs.  A class added was
    load_state_dict's size mismatch, a traceback, after config.json and classes.json were written over."""
    from vitlab.config import ConfigError
    from vitlab.train.overrides import with_changes

    data = _pngs(tmp_path / "d", 0)
    cfg = with_changes(tiny("run", steps=2, batch_size=8, val_split=0, cache_dir=str(tmp_path / "cache")),
                       {"data.source": str(data)})
    train(cfg, verbose=False)
    out = Path(cfg.run.out)
    records = {name: (out / name).read_text() for name in ("config.json", "classes.json")}
    (data / "c0").rename(data / "c2")  # the same count of classes: ['c1', 'c2'], 'c1' now label 0
    with pytest.raises(ConfigError, match=r"^--resume: the data's classes are not the checkpoint's run's, it lacks "
                                          r"'c0'; it adds 'c2'"):
        train(cfg, resume=True, verbose=False)
    _pngs(tmp_path / "more", 1)
    (tmp_path / "more" / "c0").rename(data / "c0")  # a class gained: ['c0', 'c1', 'c2']
    with pytest.raises(ConfigError, match=r"^--resume: the data's classes are not the checkpoint's run's, it adds "
                                          r"'c2'"):
        train(cfg, resume=True, verbose=False)
    # a refused resume (its classes, or its settings) leaves the run's records as they were
    with pytest.raises(ConfigError, match=r"^--resume: optim.steps=4 \(checkpoint: 2\)"):
        train(with_changes(cfg, {"optim.steps": 4}), resume=True, verbose=False)
    assert {name: (out / name).read_text() for name in records} == records
    shutil.rmtree(data / "c2")
    assert train(cfg, resume=True, verbose=False)["steps"] == 2


def test_resume_refuses_a_data_folder_with_an_image_swapped_for_another(tiny, tmp_path):
    """One image of the data swapped for another since the checkpoint (as many images, the same classes): the
    run was resumed without a word, its place in the data going on over other images, and its curves scored on
    another held-out part, which could hold images it had trained on.  A checkpoint records which images its
    parts held (``split_key``); one of an earlier version, without it, is resumed as it was."""
    import numpy as np
    from PIL import Image

    from vitlab.config import ConfigError
    from vitlab.train.overrides import with_changes

    data = _pngs(tmp_path / "d", 0)
    cfg = with_changes(tiny("run", steps=2, batch_size=8, val_split=6, cache_dir=str(tmp_path / "cache")),
                       {"data.source": str(data)})
    train(cfg, verbose=False)
    (data / "c1" / "5.png").unlink()
    Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(data / "c1" / "50.png")
    with pytest.raises(ConfigError, match=r"^--resume: the data changed since the checkpoint \(now [^)]*, as many "
                                          r"as the checkpoint's but not all the same images\); an exact continuation"):
        train(cfg, resume=True, verbose=False)
    from vitlab.train.state import check_same_split

    check_same_split({"train": "18-ab", "held_out": "6-cd"}, None)  # a checkpoint without the key


def test_resume_takes_the_runs_class_names_in_another_unicode_spelling():
    """A data folder copied again from a Mac names its classes decomposed (NFD): the same names in the
    same order are the run's classes (``same_spelling``); in another order they are refused."""
    from vitlab.config import ConfigError
    from vitlab.train.state import check_same_classes

    check_same_classes(["cafe\u0301", "tea"], ["caf\u00e9", "tea"])
    with pytest.raises(ConfigError, match=r"the same 2 names in another order \(class 0 is 'tea', not 'a'\)"):
        check_same_classes(["tea", "a"], ["a", "tea"])


def test_resume_refuses_another_number_of_steps_without_a_time_limit(tiny):
    import pytest

    from vitlab.config import ConfigError

    train(tiny("run", steps=2), verbose=False)
    # the schedule is the checkpoint's: asked for 4 steps, the resumed run stopped at its 2 without a word
    with pytest.raises(ConfigError, match=r"^--resume: optim.steps=4 \(checkpoint: 2\): a resumed run keeps its "):
        train(tiny("run", steps=4), resume=True, verbose=False)
    assert train(tiny("run", steps=2), resume=True, verbose=False)["steps"] == 2


def test_resume_refuses_optimiser_settings_its_checkpoint_restores(tiny):
    from vitlab.config import ConfigError

    train(tiny("run", steps=2, ema_decay=0.9), verbose=False)
    # the optimiser's and the EMA's saved state set weight decay, betas and decay back to the checkpoint's:
    # asked for 0.5, the resumed run trained on at 0.1 without a word
    for changes, named in (({"weight_decay": 0.5}, r"optim.weight_decay=0.5 \(checkpoint: 0.1\)"),
                           ({"optim.betas": (0.5, 0.9)}, r"optim.betas=\(0.5, 0.9\) \(checkpoint: \(0.9, 0.999\)\)"),
                           ({"ema_decay": 0.5}, r"optim.ema_decay=0.5 \(checkpoint: 0.9\)")):
        with pytest.raises(ConfigError, match=rf"^--resume: {named}: the checkpoint's optimiser state"):
            train(tiny("run", **({"steps": 2, "ema_decay": 0.9} | changes)), resume=True, verbose=False)
    assert train(tiny("run", steps=2, ema_decay=0.9), resume=True, verbose=False)["steps"] == 2


def test_a_finished_run_resumed_with_other_settings_is_refused_and_its_records_kept(tiny):
    from vitlab.config import ConfigError

    first = train(tiny("run", steps=2, ckpt_every=1), verbose=False)
    config = Path(first["weights"]).with_name("config.json")
    recorded = config.read_text()
    # nothing trains after a finished run's last step: its config.json, written again, claimed the new settings
    for changes, named in (({"clip_norm": 0.01}, r"optim.clip_norm=0.01 \(its run: 1.0\)"),
                           ({"flip": True}, r"augment.flip=True \(its run: False\)"),
                           ({"lr": 0.5}, r"optim.lr=0.5 \(its run: 0.003\)")):
        with pytest.raises(ConfigError, match=rf"^--resume: .* had finished at step 2; {named} would train nothing"):
            train(tiny("run", steps=2, ckpt_every=1, **changes), resume=True, verbose=False)
        assert config.read_text() == recorded
    assert train(tiny("run", steps=2, ckpt_every=1), resume=True, verbose=False)["steps"] == 2
    # an unfinished run takes them from its resumption on, and its records say so
    (Path(first["weights"]).parent / "checkpoints" / "ckpt-00000002.pt").unlink()
    assert train(tiny("run", steps=2, ckpt_every=1, clip_norm=0.01), resume=True, verbose=False)["steps"] == 2
    assert json.loads(config.read_text())["optim"]["clip_norm"] == 0.01


def test_a_resumed_run_that_stops_before_saving_a_step_under_new_settings_keeps_its_config(tiny):
    from vitlab.train.numerics import NonFiniteError

    cfg = tiny("run", steps=6, ckpt_every=3, log_every=1)
    train(cfg, verbose=False)
    out = Path(cfg.run.out)
    for name in ("ckpt-00000006.pt", "../summary.json", "../model.safetensors"):  # as if it died after step 3
        (out / "checkpoints" / name).unlink()
    recorded = (out / "config.json").read_text()
    # step 4 takes the new rate and step 5 is not finite, before the checkpoint of step 6: the config.json
    # claimed a rate nothing the folder holds was trained with
    with pytest.raises(NonFiniteError, match=r"^step 5: .* the last good checkpoint is .*ckpt-00000003.pt"):
        train(tiny("run", steps=6, ckpt_every=3, log_every=1, lr=1e30), resume=True, verbose=False)
    assert (out / "config.json").read_text() == recorded
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["ckpt-00000003.pt"]
    # once a checkpoint holds steps under them, it states them
    assert train(tiny("run", steps=6, ckpt_every=3, log_every=1, lr=1e-3), resume=True, verbose=False)["steps"] == 6
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 1e-3


def test_a_finished_run_resumed_with_another_length_or_time_limit_is_refused_and_its_records_kept(tiny, run_clock):
    from vitlab.config import ConfigError

    # a time limit makes optim.steps a ceiling: resumed at its end with another ceiling or limit (or a limit
    # given to a run that had none), it trained no step more and its config.json claimed the new length
    first = train(tiny("run", steps=4), verbose=False)
    config = Path(first["weights"]).with_name("config.json")
    recorded = config.read_text()
    for changes, named in (({"time_limit": 5.0}, r"run.time_limit=5.0 \(its run: 0.0\)"),
                           ({"time_limit": 5.0, "steps": 8, "warmup": 1}, r"optim.steps=8 \(its run: 4\)")):
        with pytest.raises(ConfigError, match=rf"^--resume: .* had finished at step 4; {named}.* would train nothing"):
            train(tiny("run", **({"steps": 4} | changes)), resume=True, verbose=False)
        assert config.read_text() == recorded
    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    timed = dict(steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1, tensorboard=False)
    summary = train(tiny("timed", **timed), verbose=False)
    config = Path(summary["weights"]).with_name("config.json")
    recorded = config.read_text()
    for changes, named in (({"steps": 2_000_000}, r"optim.steps=2000000 \(its run: 1000000\)"),
                           ({"time_limit": 0.2}, r"run.time_limit=0.2 \(its run: 0.1\)")):
        with pytest.raises(ConfigError, match=rf"^--resume: .* had finished at step {summary['steps']}; {named} would"):
            train(tiny("timed", **(timed | changes)), resume=True, verbose=False)
        assert config.read_text() == recorded
    assert train(tiny("timed", **timed), resume=True, verbose=False)["steps"] == summary["steps"]


def test_a_finished_run_resumed_at_its_end_keeps_its_summarys_measures_of_the_steps(tiny):
    # it takes no step: its summary, written again, gave data_wait (and a GPU run's MFU fields) as None
    first = train(tiny("run", steps=4), verbose=False)
    assert first["data_wait"] is not None
    path = Path(first["weights"]).with_name("summary.json")
    path.write_text(json.dumps(json.loads(path.read_text()) | {"mfu": 0.25, "step_images_per_s": 900.0}))
    again = train(tiny("run", steps=4), resume=True, verbose=False)
    assert again["data_wait"] == first["data_wait"]
    assert (again.get("mfu"), again.get("step_images_per_s")) == (0.25, 900.0)
    assert json.loads(path.read_text())["data_wait"] == first["data_wait"]
    assert (again["val_top1"], again["steps"]) == (first["val_top1"], 4)


def fitted_total(minutes: float, eval_s: float = EVAL_S) -> int:
    """The total a time-limited run of ``STEP_S`` steps fits after its 2 + 3 timed steps and one
    timed evaluation of ``eval_s``: the steps left until the deadline less the final
    evaluation (and its quarter of margin) and the reserve (``time_budget``)."""
    budget_s = minutes * 60
    left = budget_s - (5 * STEP_S + eval_s) - 1.25 * eval_s - (5.0 + 0.005 * budget_s)
    return 5 + int(left // STEP_S)


def test_time_limit_fits_the_schedule(tiny, run_clock):
    # 0.1 min budget, steps of 1/64 s on the run's clock: after 2 + 3 timed steps and an evaluation the
    # total is fixed, and the run decays to its end, its final evaluation done with the reserve left
    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    summary = train(tiny("timed", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1,
                         tensorboard=False), verbose=False)
    assert summary["steps"] == summary["planned_steps"] == fitted_total(0.1)
    assert summary["wall_s"] == round(summary["steps"] * STEP_S + 2 * EVAL_S, 2)  # the fit's evaluation, the final one
    assert summary["wall_s"] <= 0.1 * 60 - 5.0


def test_a_run_the_time_limit_stops_early_reports_the_steps_it_planned(tiny, monkeypatch):
    # the guard (a machine slower than planned) ends the run at step 3 of a schedule of 6: the summary said
    # planned_steps 3, as if the schedule had been of 3 steps and its decay had run to its end
    from vitlab.train.time_budget import TimeBudget

    monkeypatch.setattr(TimeBudget, "out_of_time", lambda self, step, total_steps: step == 3)
    summary = train(tiny("cut", steps=6, tensorboard=False), verbose=False)
    assert (summary["steps"], summary["planned_steps"]) == (3, 6)
    assert json.loads((Path(summary["weights"]).parent / "summary.json").read_text())["planned_steps"] == 6
    # resumed, the finished run's checkpoint says so too
    resumed = train(tiny("cut", steps=6, tensorboard=False), resume=True, verbose=False)
    assert (resumed["steps"], resumed["planned_steps"]) == (3, 6)


def test_time_limit_counts_from_started_at(tiny, run_clock):
    # the CLI passes its process's start: a budget already spent by then (here all of it) leaves
    # the steps until the first one timed, and the final evaluation: after step 3 the schedule is
    # fitted to one more step, which does not fit, and the guard stops the run
    clock = run_clock(step_s=STEP_S, eval_s=EVAL_S)
    summary = train(tiny("timed_started", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1,
                         tensorboard=False), verbose=False, started_at=clock.now - 0.1 * 60)
    assert (summary["steps"], summary["planned_steps"]) == (3, 4)
    assert summary["wall_s"] == round(0.1 * 60 + 3 * STEP_S + EVAL_S, 2)  # counted from started_at, not from the call


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads the process start from Linux's /proc")
def test_process_started_at_counts_the_time_before_train_is_called():
    # a process that idles for a second before asking: its start lies that second back
    code = ("import time; time.sleep(1.0); from vitlab.cli.train import process_started_at; "
            "print(time.monotonic() - process_started_at())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= age < 60.0


def capture_refits(monkeypatch) -> Callable[[], list[tuple[int, int]]]:
    """Record the time limit's progress messages; the returned function lists the
    (first, last) step of each stretch a refit timed, in order."""
    from vitlab.train.metrics import Progress

    messages = []
    monkeypatch.setattr(Progress, "message", lambda self, text: messages.append(text))
    pattern = re.compile(r"ms/step over steps (\d+)-(\d+) ->")
    return lambda: [(int(a), int(b)) for a, b in pattern.findall("\n".join(messages))]


def test_time_limit_refits_over_consecutive_stretches(tiny, run_clock, monkeypatch):
    # after the warm-up's refit, one halfway through the decay and one at three quarters,
    # each timed over the steps since the one before (the latest speed of the machine)
    from vitlab.train.schedules import warmup_steps

    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    refits = capture_refits(monkeypatch)
    cfg = tiny("timed_refits", steps=1_000_000, time_limit=0.15, time_measure_steps=3, warmup=0.1, tensorboard=False)
    summary = train(cfg, verbose=False)
    total = fitted_total(0.15)  # steps of one speed: every refit keeps the first fit's total
    assert summary["steps"] == summary["planned_steps"] == total
    warm_end = max(warmup_steps(cfg.optim, total), 5 + 2 * 3)  # the warm-up's end, or two timings after the fit
    mid = warm_end + (total - warm_end) // 2  # halfway from the previous refit to the end then planned
    late = mid + (total - mid) // 2
    assert refits() == [(5, warm_end), (warm_end, mid), (mid, late)]


def test_time_limit_times_every_periodic_evaluation(tiny, run_clock):
    # the evaluation cost the refits and the guard plan with is a mean over all periodic
    # evaluations so far: the one timed for the first fit (step 5) and each one after it
    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    cfg = tiny("timed_evals", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1, eval_every=7,
               tensorboard=False)
    summary = train(cfg, verbose=False)
    records = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    periodic = [r for r in records if "val_top1" in r and r["step"] < summary["steps"]]
    assert [r["step"] for r in periodic] == list(range(7, summary["steps"], 7)) and len(periodic) >= 2
    clock = load_checkpoint(list_checkpoints(f"{cfg.run.out}/checkpoints")[-1])["clock"]
    assert clock["evals_timed"] == 1 + len(periodic)
    assert clock["eval_s"] == EVAL_S


@pytest.mark.parametrize("kept, steps", [(3, 1), (2, 3)])
def test_a_resumed_time_limited_run_counts_the_time_already_spent(tiny, run_clock, kept, steps):
    # the checkpoint carries the run's clock; a run whose checkpoint says the budget is
    # spent stops at once (final evaluation only) instead of starting a fresh budget: one
    # step after a checkpoint taken after the first fit (step 6), then the guard; after one
    # taken before it (step 4), the steps it times to fit its schedule (to the next step)
    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    cfg = tiny("timed_resume", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1, ckpt_every=2,
               keep_ckpts=100_000, tensorboard=False)
    full = train(cfg, verbose=False)
    ckpts = list_checkpoints(f"{cfg.run.out}/checkpoints")
    first = load_checkpoint(ckpts[0])
    assert first["step"] == 2
    assert first["clock"] == {"elapsed_s": 2 * STEP_S, "eval_s": 0.0, "evals_timed": 0, "planned": False}
    last = load_checkpoint(ckpts[-1])
    assert last["clock"]["eval_s"] == EVAL_S and last["clock"]["planned"]  # measured with the fit, at step 5
    for p in ckpts[kept:]:  # stopped after a checkpoint...
        p.unlink()
    state = load_checkpoint(ckpts[kept - 1])
    state["clock"]["elapsed_s"] = 0.1 * 60  # ...when the whole budget had gone
    torch.save(state, ckpts[kept - 1])
    resumed = train(cfg, resume=True, verbose=False)
    assert resumed["steps"] == state["step"] + steps < full["steps"]
    assert resumed["wall_s"] == round(0.1 * 60 + steps * STEP_S + EVAL_S, 2)  # and its final evaluation
    logged = read_jsonl(f"{cfg.run.out}/metrics.jsonl")
    assert logged[-1]["elapsed_s"] == 0.1 * 60 + steps * STEP_S + EVAL_S


def test_a_resumed_time_limited_run_times_its_steps_again(tiny, run_clock, monkeypatch):
    # the restarted process may run on another machine: from two steps after the restart
    # (the first ones compile) the decay's refits time the steps anew
    clock = run_clock(step_s=STEP_S, eval_s=EVAL_S)
    cfg = tiny("timed_remeasure", steps=1_000_000, time_limit=0.12, time_measure_steps=3, warmup=0.1, ckpt_every=2,
               keep_ckpts=100_000, tensorboard=False)
    train(cfg, verbose=False)
    ckpts = list_checkpoints(f"{cfg.run.out}/checkpoints")
    for p in ckpts[3:]:  # stopped after its third checkpoint, step 6...
        p.unlink()
    state = load_checkpoint(ckpts[2])
    state["clock"]["elapsed_s"] = 0.0  # ...with all its budget left
    torch.save(state, ckpts[2])
    refits = capture_refits(monkeypatch)
    clock.step_s = 2 * STEP_S  # ...and resumed on a machine half as fast
    resumed = train(cfg, resume=True, verbose=False)
    # the first refit halfway from step 8 to the end planned before, over the steps timed since
    # step 8; it fits the steps of the new speed that are left, the second refit halfway to that end
    first_end = 8 + (fitted_total(0.12) - 8) // 2
    left = 0.12 * 60 - (first_end - 6) * 2 * STEP_S - 1.25 * EVAL_S - (5.0 + 0.005 * 0.12 * 60)
    total = first_end + int(left // (2 * STEP_S))
    assert refits() == [(8, first_end), (first_end, first_end + (total - first_end) // 2)]
    assert resumed["steps"] == resumed["planned_steps"] == total


@pytest.mark.parametrize("ckpt_every, resumed_at", [(2, 2), (2, 4), (5, 5)])
def test_a_time_limited_run_resumed_before_its_first_fit_fits_its_schedule(tiny, run_clock, ckpt_every, resumed_at):
    # a checkpoint of before the first fit (after step 5) holds optim.steps as the schedule: resumed from
    # it, the run kept a million steps, its lr in their warm-up (a thousandth of its peak), until the
    # guard stopped it, planned_steps 1,000,000. Now it times its steps again from two after the restart
    # and fits then, counting the time already spent: the steps of the uninterrupted run. A checkpoint
    # taken at the fit's step holds the fitted schedule, which the resumed run keeps
    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    cfg = tiny("timed_early", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1,
               ckpt_every=ckpt_every, keep_ckpts=100_000, tensorboard=False)
    full = train(cfg, verbose=False)
    assert full["steps"] == full["planned_steps"] == fitted_total(0.1)
    ckpts = list_checkpoints(f"{cfg.run.out}/checkpoints")
    kept = ckpts[resumed_at // ckpt_every - 1]
    assert load_checkpoint(kept)["clock"]["planned"] == (resumed_at >= 5)
    for p in ckpts[resumed_at // ckpt_every:]:
        p.unlink()
    resumed = train(cfg, resume=True, verbose=False)
    assert resumed["steps"] == resumed["planned_steps"] == fitted_total(0.1)
    # the timing evaluation (again, when the fit is made again), then the final one
    assert resumed["wall_s"] == round(resumed["steps"] * STEP_S + 2 * EVAL_S, 2)
    lrs = [r["lr"] for r in read_jsonl(f"{cfg.run.out}/metrics.jsonl") if r["step"] > resumed_at]
    assert max(lrs) == pytest.approx(cfg.optim.lr, rel=0.05)  # the warm-up reached its peak


def test_flip_evaluation_scores_the_two_view_ensemble(tiny):
    from vitlab.eval import Evaluator
    from vitlab.eval.features import predict_logits
    from vitlab.train.inputs import build_splits

    summary = train(tiny("flip", eval_flip=True, steps=20, tensorboard=False), verbose=False)
    model = load_model(summary["weights"]).eval()
    splits = build_splits(tiny("flip"), (8, 8))
    labels = splits.val_labels.numpy()
    single = (predict_logits(model, splits.val_images).argmax(-1) == labels).mean()
    averaged = (predict_logits(model, splits.val_images, flip=True).argmax(-1) == labels).mean()
    assert summary["val_top1"] == averaged and summary["val_top1_single"] == single
    plain = Evaluator(splits.val_images, splits.val_labels, batch_size=32, device="cpu").run(model)
    assert plain["top1"] == single and "top1_single" not in plain


def test_final_evaluation_adds_shifted_views_and_the_periodic_ones_do_not(tiny):
    from vitlab.config import ConfigError
    from vitlab.eval.features import predict_logits
    from vitlab.train.inputs import build_splits

    summary = train(tiny("shift", eval_flip=True, final_eval_shift=2, steps=20, eval_every=10,
                         tensorboard=False), verbose=False)
    model = load_model(summary["weights"]).eval()
    splits = build_splits(tiny("shift"), (8, 8))
    labels = splits.val_labels.numpy()
    top1 = {name: (predict_logits(model, splits.val_images, **views).argmax(-1) == labels).mean()
            for name, views in {"single": {}, "flip": dict(flip=True), "all": dict(flip=True, shift=2)}.items()}
    assert len(set(top1.values())) == 3  # the three protocols score differently here, so a mix-up shows
    assert summary["val_top1"] == top1["all"]
    assert summary["val_top1_flip"] == top1["flip"] and summary["val_top1_single"] == top1["single"]
    evaluated = [r for r in read_jsonl(f"{tiny('shift').run.out}/metrics.jsonl") if "val_top1" in r]
    assert [r["step"] for r in evaluated] == [10, 20]
    assert "val_top1_flip" not in evaluated[0] and "val_top1_flip" in evaluated[1]  # only the final one
    with pytest.raises(ConfigError, match="final_eval_shift=8"):  # the 8x8 input cannot shift by 8
        train(tiny("shift8", final_eval_shift=8), verbose=False)


def test_a_pad_the_images_cannot_reflect_is_refused_by_its_field_before_any_work(tiny):
    """augment.crop_pad of the 8x8 images' 8 pixels or more: refused naming the field, before the run's
    folder is made or its data decoded; it was a ValueError naming 'pad=8' at the first step."""
    from pathlib import Path

    from vitlab.config import ConfigError

    cfg = tiny("pad8", crop="pad", crop_pad=8)
    with pytest.raises(ConfigError, match=r"^augment.crop_pad=8: reflect padding needs 0 <= augment.crop_pad < "
                                          r"min\(H, W\) = 8 for 8x8 images"):
        train(cfg, verbose=False)
    assert not Path(cfg.run.out).exists()
    assert train(tiny("pad7", crop="pad", crop_pad=7, steps=1), verbose=False)["steps"] == 1


def test_final_evaluation_scores_every_nested_set_of_views_in_one_pass(tiny):
    from vitlab.config import ConfigError
    from vitlab.eval.features import predict_logits
    from vitlab.train.inputs import build_splits

    summary = train(tiny("grid", eval_flip=True, final_eval_shift=[2, 1], steps=20, tensorboard=False,
                         **{"run.final_eval_diagonal": True}), verbose=False)
    model = load_model(summary["weights"]).eval()
    splits = build_splits(tiny("grid"), (8, 8))
    labels = splits.val_labels.numpy()
    protocols = {1: {}, 2: dict(flip=True), 10: dict(flip=True, shift=2), 18: dict(flip=True, shift=2, diagonal=True),
                 34: dict(flip=True, shift=(2, 1), diagonal=True)}
    top1 = {k: (predict_logits(model, splits.val_images, **views).argmax(-1) == labels).mean()
            for k, views in protocols.items()}
    assert len(set(top1.values())) >= 3  # the protocols score differently here, so a mix-up shows
    assert list(summary["val_top1_views"]) == [1, 2, 10, 18, 26, 34]
    for k, want in top1.items():
        assert summary["val_top1_views"][k] == pytest.approx(want), k
    assert summary["val_top1"] == pytest.approx(top1[34])
    saved = json.loads((Path(tiny("grid").run.out) / "summary.json").read_text())
    assert saved["val_top1_views"]["10"] == summary["val_top1_views"][10]
    with pytest.raises(ConfigError, match="run.final_eval_diagonal"):
        tiny("diag_alone", **{"run.final_eval_diagonal": True})
    with pytest.raises(ConfigError, match=r"run.final_eval_shift=\(2, 2\)"):
        tiny("twice", final_eval_shift=(2, 2))
    with pytest.raises(ConfigError, match=r"final_eval_shift=\(2, 8\)"):  # the 8x8 input cannot shift by 8
        train(tiny("shift28", final_eval_shift=(2, 8)), verbose=False)


def test_train_leaves_alone_a_process_group_it_did_not_create(tiny, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        train(tiny("own_group", steps=2, tensorboard=False), verbose=False)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def record_input_sizes(monkeypatch) -> list[tuple[bool, int]]:
    """(training?, side) of every batch the model built by the loop is called on."""
    import vitlab.train.build as building

    seen, build = [], building.make_model

    def recording(cfg, num_classes, img_size):
        model = build(cfg, num_classes, img_size)
        model.register_forward_pre_hook(lambda module, args: seen.append((module.training, args[0].shape[-1])))
        return model

    monkeypatch.setattr(building, "make_model", recording)
    return seen


def test_progressive_sizes_shrink_the_early_training_batches(tiny, monkeypatch):
    from vitlab.train import loop

    seen = record_input_sizes(monkeypatch)
    rates, real = [], loop.utilization
    monkeypatch.setattr(loop, "utilization", lambda setup, rate: rates.append(rate) or real(setup, rate))
    cfg = tiny("progressive", steps=8, progressive_sizes=((4, 0.5),))
    summary = train(cfg, verbose=False)
    assert [side for training, side in seen if training] == [4] * 4 + [8] * 4
    assert {side for training, side in seen if not training} == {8}  # evaluation at the model's size
    assert load_model(summary["weights"]).cfg.img_size == (8, 8)
    # the MFU's rate times the full-size steps that neither compile nor change size: steps 6, 7 and 8
    assert rates[0].images == 3 * 32 and rates[0].seconds > 0
    # on a CPU the summary has no MFU, printed or written
    written = json.loads((Path(cfg.run.out) / "summary.json").read_text())
    assert not {"mfu", "peak_bf16_tflops", "achieved_tflops"} & (summary.keys() | written.keys())


def test_progressive_sizes_the_model_cannot_take_are_refused(tiny):
    from vitlab.config import ConfigError

    with pytest.raises(ConfigError, match=r"progressive_sizes=.*patches"):
        train(tiny("odd", progressive_sizes=((6, 0.5),)), verbose=False)
    with pytest.raises(ConfigError, match=r"progressive_sizes=.*not below"):
        train(tiny("big", progressive_sizes=((8, 0.5),)), verbose=False)
    with pytest.raises(ConfigError, match=r"data.progressive_sizes=\(24, 0.5\)"):
        train(tiny("flat", progressive_sizes=(24, 0.5)), verbose=False)


def test_a_non_square_run_trains_on_its_images_as_they_are(tiny, monkeypatch):
    """A run at 8x12 resized each training batch to its height by its height (8x8), which the model
    built for 8x12 refused at the first step; progressive phases (square) are refused before any data."""
    import vitlab.train.build as building
    import vitlab.train.inputs as inputs
    from vitlab.config import ConfigError

    sizes, build = [], building.make_model

    def recording(cfg, num_classes, img_size):
        model = build(cfg, num_classes, img_size)
        model.register_forward_pre_hook(lambda module, args: sizes.append(tuple(args[0].shape[-2:])))
        return model

    monkeypatch.setattr(building, "make_model", recording)
    summary = train(tiny("wide", steps=3, img_size=(8, 12)), verbose=False)
    assert set(sizes) == {(8, 12)} and load_model(summary["weights"]).cfg.img_size == (8, 12)
    monkeypatch.setattr(inputs, "load_labelled", lambda *a, **k: pytest.fail("the data was read"))
    with pytest.raises(ConfigError, match=r"^data.progressive_sizes=\(\(4, 0.5\),\): its phases are square images, "
                                          "and this run trains at 8x12"):
        train(tiny("wide_phases", img_size=(8, 12), progressive_sizes=((4, 0.5),)), verbose=False)


def test_time_limit_plans_the_cheaper_early_steps(tiny, run_clock, monkeypatch):
    # the planner times steps in full-size steps, and its plan, early small steps included,
    # still ends within the budget: 4-pixel steps a quarter of the 8-pixel ones' 1/64 s
    from vitlab.train.metrics import Progress
    from vitlab.train.schedules import schedule_cost

    messages = []
    monkeypatch.setattr(Progress, "message", lambda self, text: messages.append(text))
    run_clock(step_s=lambda size: STEP_S * size[0] * size[1] / 64, eval_s=EVAL_S)
    phases = ((4, 0.5),)
    cfg = tiny("timed_progressive", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1,
               progressive_sizes=phases, tensorboard=False)
    summary = train(cfg, verbose=False)
    # the fit and each refit timed the 4-pixel steps as the quarter of an 8-pixel one they are
    assert re.findall(r"(\d+) ms per 8-pixel step", "\n".join(messages)) == ["16"] * 4, messages
    # the most steps whose costs, the first half's a quarter, fit in what the first fit found left
    left = 0.1 * 60 - (5 * STEP_S / 4 + EVAL_S) - 1.25 * EVAL_S - (5.0 + 0.005 * 0.1 * 60)
    total = 5
    while STEP_S * schedule_cost(5, total + 1, phases, (8, 8)) <= left:
        total += 1
    assert summary["steps"] == summary["planned_steps"] == total
    assert summary["wall_s"] <= 0.1 * 60 - 5.0


@pytest.mark.parametrize("auto", ["bf16", "fp32"])
def test_auto_is_resolved_once_when_the_run_is_built_and_recorded(tiny, monkeypatch, auto):
    # the machine and the stored calibration are read when the run is built, never by a step
    # or an evaluation: a calibration stored while the run trains cannot change its arithmetic
    from vitlab import fast
    from vitlab.fast import kernels
    from vitlab.train.metrics import Progress
    from vitlab.train.step import autocast

    asked, lines = [], []
    monkeypatch.setattr(fast, "cpu_precision", lambda *cpu: asked.append("cpu") or auto)
    chosen = kernels.KernelChoice(fp32="aten", attention="explicit")
    monkeypatch.setattr(fast, "choose", lambda **cpu: asked.append("kernels") or chosen)
    monkeypatch.setattr(Progress, "message", lambda self, text: lines.append(text))
    cfg = tiny("resolved", precision="auto", steps=4, eval_every=2, **{"run.threads": 1})
    summary = train(cfg, verbose=True)
    assert summary["steps"] == 4
    assert asked == ["cpu", "kernels"]  # once each, for the whole run (4 steps, 3 evaluations)
    record = json.loads((Path(cfg.run.out) / "config.json").read_text())["resolved"]
    assert record["precision"] == auto and record["device"] == "cpu" and record["threads"] == 1
    assert record["kernels"]["attention"] == "explicit" and record["data"] == "memory" and record["compile"] == "off"
    stated = json.loads((Path(cfg.run.out) / "config.json").read_text())["run"]
    assert record["compile_optimizer"] == "off" and stated["compile_optimizer"] is False  # "auto", stated
    assert lines[0].startswith(f"resolved: device cpu, precision {auto}, kernels fp32 aten, bf16 aten, "
                               "attention explicit")
    with pytest.raises(ValueError, match="precision='auto'.*resolve 'auto' when the run is built"):
        autocast(torch.device("cpu"), "auto")
    with autocast(torch.device("cpu"), "bf16"):
        assert torch.is_autocast_enabled("cpu")
    with autocast(torch.device("cpu"), "fp32"):
        assert not torch.is_autocast_enabled("cpu")


def test_a_resumed_run_keeps_the_precision_and_kernels_it_started_with(tiny, monkeypatch):
    from vitlab import fast
    from vitlab.fast import kernels

    monkeypatch.setattr(fast, "cpu_precision", lambda *cpu: "bf16")
    monkeypatch.setattr(fast, "choose", lambda **cpu: kernels.KernelChoice(attention="explicit"))
    cfg = tiny("resumed", precision="auto", steps=4, **{"run.ckpt_every": 2})
    train(cfg, verbose=False)
    list_checkpoints(Path(cfg.run.out) / "checkpoints")[-1].unlink()  # as if killed after step 2's checkpoint
    # the machine's answer changes (a calibration stored meanwhile): the run continues as it began
    monkeypatch.setattr(fast, "cpu_precision", lambda *cpu: "fp32")
    monkeypatch.setattr(fast, "choose", lambda **cpu: kernels.KernelChoice())
    train(cfg, resume=True, verbose=False)
    resolved = json.loads((Path(cfg.run.out) / "config.json").read_text())["resolved"]
    assert resolved["precision"] == "bf16" and resolved["kernels"]["attention"] == "explicit"
    state = load_checkpoint(list_checkpoints(Path(cfg.run.out) / "checkpoints")[-1])
    assert state["step"] == 4 and state["resolved"]["precision"] == "bf16"


def test_a_run_gives_its_caller_back_the_thread_count_and_random_streams(tiny):
    import random

    import numpy as np

    torch.set_num_threads(2)
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    expected = (torch.rand(3), np.random.rand(), random.random())
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    train(tiny("scoped", steps=2, **{"run.threads": 1, "run.seed": 7}), verbose=False)
    assert torch.get_num_threads() == 2
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_the_fast_path_is_applied_by_default_and_no_fast_saves_the_same_weights(tiny, monkeypatch):
    # vitlab.fast.optimize runs on the bare model before any wrapper; run.fast=False runs the
    # plain model; either way the weights file holds the same tensors under the same keys
    from safetensors import safe_open

    from vitlab import fast

    optimized = []
    original = fast.optimize
    monkeypatch.setattr(fast, "optimize", lambda model, *a, **kw: optimized.append(type(model).__name__)
                        or original(model, *a, **kw))
    with_fast = train(tiny("fast"), verbose=False)
    assert len(optimized) == 1
    plain = train(tiny("plain", **{"run.fast": False}), verbose=False)
    assert len(optimized) == 1
    saved = []
    for summary in (with_fast, plain):
        with safe_open(summary["weights"], "pt") as f:
            saved.append({k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()})
    assert saved[0] == saved[1] and saved[0]


def test_mallopt_is_opt_in(tiny, monkeypatch):
    import vitlab.train.loop as looping

    calls = []
    monkeypatch.setattr(looping, "retain_freed_memory", lambda: calls.append(1) or True)
    train(tiny("default"), verbose=False)
    assert calls == []
    train(tiny("retain", retain_freed_memory=True), verbose=False)
    assert calls == [1]


def test_a_checkpoint_with_the_old_flat_config_resumes(tiny):
    # checkpoints written before the config had sections hold its flat dict
    from vitlab.config import ConfigError
    from vitlab.train.config import to_dict
    from vitlab.train.legacy import LEGACY_NAMES

    cfg = tiny("flat", steps=4, ckpt_every=2, keep_ckpts=3)
    full = train(cfg, verbose=False)
    ckpts = list_checkpoints(f"{cfg.run.out}/checkpoints")
    ckpts[-1].unlink()
    state = load_checkpoint(ckpts[0])
    nested = to_dict(cfg)
    state["config"] = {old: nested[new.split(".")[0]][new.split(".")[1]] if "." in new else nested[new]
                       for old, new in LEGACY_NAMES.items()}
    assert "batch_size" in state["config"] and "optim" not in state["config"]
    torch.save(state, ckpts[0])
    resumed = train(cfg, resume=True, verbose=False)
    a, b = weights(full), weights(resumed)
    assert resumed["steps"] == 4 and all(torch.equal(a[k], b[k]) for k in a)
    state["config"]["batch_size"] = 16  # and a changed data order is still refused
    torch.save(state, ckpts[0])
    list_checkpoints(f"{cfg.run.out}/checkpoints")[-1].unlink()
    with pytest.raises(ConfigError, match="batch_size=32 .checkpoint: 16."):
        train(cfg, resume=True, verbose=False)


READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@pytest.mark.parametrize("optimizer, precision", [("adam", "fp32"), ("muon", "bf16"), ("sgd", "fp32")])
def test_a_step_reads_nothing_back_from_the_device_between_log_steps(tiny, monkeypatch, optimizer, precision):
    # every way a tensor's value reaches Python is counted while the loop trains: inside a step
    # and between steps none may happen; the log steps read the window and the flags
    import vitlab.train.loop as loop
    from vitlab.train.numerics import NonFinite

    where = {"now": None}  # None: not counted (building, saving the final weights)
    reads: list[tuple[str, str]] = []

    def counting(name, original):
        def read(self, *args, **kwargs):
            if where["now"] is not None:
                reads.append((where["now"], name))
            return original(self, *args, **kwargs)
        return read

    def inside(label, function, after):
        def run(*args, **kwargs):
            before = where["now"]
            where["now"] = label
            try:
                return function(*args, **kwargs)
            finally:
                where["now"] = after if after != "unchanged" else before
        return run

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(loop, "train_step", inside("step", loop.train_step, after="between steps"))
    for name in ("evaluate", "save_checkpoint", "training_state"):
        monkeypatch.setattr(loop, name, inside("log step", getattr(loop, name), after="unchanged"))
    monkeypatch.setattr(loop.Window, "record", inside("log step", loop.Window.record, after="unchanged"))
    monkeypatch.setattr(NonFinite, "check", inside("log step", NonFinite.check, after="unchanged"))
    monkeypatch.setattr(loop, "finish", inside(None, loop.finish, after=None))

    summary = train(tiny(f"reads-{optimizer}", optimizer=optimizer, precision=precision, momentum=0.9, steps=10,
                         log_every=5, ema_decay=0.9, accum_steps=2), verbose=True)
    assert summary["steps"] == 10
    assert [r for r in reads if r[0] != "log step"] == []
    assert reads  # the log steps do read: the counting sees them


def test_the_progress_line_shows_no_loss_before_the_first_read(tiny, capsys):
    # the loss stays on the device between records (log_every): until one is read there is none to show
    train(tiny("progress", steps=3, log_every=3, tensorboard=False), verbose=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert lines[0].startswith("[") and " 1/3 loss - " in lines[0]  # the first line comes at once
    assert re.search(r" 3/3 loss \d+\.\d{4} ", lines[-1])  # the last step is read


def test_a_time_limited_run_shows_no_total_before_its_schedule_is_fitted(tiny, run_clock, capsys):
    # before the first fit the total is optim.steps, a ceiling: "1/1000000 ... ETA 5h41m" was a made-up plan
    run_clock(step_s=STEP_S, eval_s=EVAL_S)
    summary = train(tiny("progress_timed", steps=1_000_000, time_limit=0.1, time_measure_steps=3, warmup=0.1,
                         log_every=1, tensorboard=False), verbose=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert " 1/? loss " in lines[0] and lines[0].rstrip().endswith("ETA -")
    assert "1000000" not in "".join(lines)
    assert f" {summary['steps']}/{summary['steps']} loss " in lines[-1]  # the last step (the guard's too)


def test_a_non_finite_loss_read_shows_as_such():
    import io

    from vitlab.train.metrics import Progress

    stream = io.StringIO()
    progress = Progress(stream=stream, interval_s=0.0)
    for step, loss in enumerate((None, float("nan"), float("inf"), 2.5), 1):
        progress.update(step, 4, loss, 100.0, 1.0)
    assert [line.split()[2:4] for line in stream.getvalue().splitlines()] == [
        ["loss", "-"], ["loss", "nan"], ["loss", "inf"], ["loss", "2.5000"]]


@pytest.mark.parametrize("flip", [False, True])
def test_a_sigmoid_run_reports_its_validation_loss_in_its_own_loss(tiny, flip):
    # paper_pretrain's loss: val_loss, drawn on the curves' panel beside the training loss, was the
    # softmax cross-entropy (2.3 at the start on 10 classes where the training loss was 6.9)
    import torch.nn.functional as F

    from vitlab.eval.features import predict_logits
    from vitlab.train.inputs import build_splits

    summary = train(tiny("sigmoid", loss="sigmoid_xent", eval_flip=flip, steps=4, tensorboard=False), verbose=False)
    model = load_model(summary["weights"]).eval()
    splits = build_splits(tiny("sigmoid"), (8, 8))
    views = [torch.from_numpy(predict_logits(model, images)).double()
             for images in (splits.val_images, splits.val_images.flip(-1))[:1 + flip]]
    targets = F.one_hot(splits.val_labels, 10).double()
    p = sum(z.sigmoid() for z in views) / len(views)  # the views' mean probability of each class
    expected = -(targets * p.log() + (1 - targets) * (1 - p).log()).sum(1).mean()
    assert summary["val_loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_a_bf16_run_trains_as_the_fp32_run_does(tiny, fast):
    # train() runs inside an autocast of its own (a caller's turned off), and torch keeps its casts of the
    # parameters until the outermost autocast ends: every bf16 step read the weights cast at step 0, the zero
    # head among them, and the loss stayed ln 10 (2.3026) while the fp32 run's fell
    import math

    losses = {}
    for precision in ("fp32", "bf16"):
        summary = train(tiny(precision, precision=precision, steps=30, **{"run.fast": fast}), verbose=False)
        losses[precision] = [r["loss"] for r in read_jsonl(Path(summary["weights"]).parent / "metrics.jsonl")]
    assert losses["fp32"][-1] < math.log(10) - 0.2  # the run learns: what bf16 is held to
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.02)


def test_a_runs_weights_file_carries_its_loss(tiny):
    """The run's model.safetensors records optim.loss in its metadata: copied alone, without the run's
    config.json, a sigmoid run's weights were scored as a softmax model's (predict, eval's views and ECE)."""
    from vitlab.weights import read_loss

    summary = train(tiny(steps=1, loss="sigmoid_xent"), verbose=False)
    assert read_loss(summary["weights"]) == "sigmoid_xent"
