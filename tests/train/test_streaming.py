"""The trainer on streamed data: shard sets and large folders, resume, two processes."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.config import ConfigError
from vitlab.data.shards import pack_shards
from vitlab.train import train
from vitlab.train.checkpoint import list_checkpoints, load_checkpoint
from vitlab.machine import Machine

ROOT = Path(__file__).resolve().parents[2]


def write_folder(root, classes=3, per_class=16, size=8):
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
            pixels[:, :, c] += 150
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture
def shard_set(tmp_path):
    pack_shards(write_folder(tmp_path / "folder"), tmp_path / "shards", samples_per_shard=6)  # 48 samples, 8 shards
    return tmp_path / "shards"


def test_streamed_resume_is_bit_exact(tiny, shard_set):
    cfg = tiny("run", data=str(shard_set), val_split=0, steps=8, ckpt_every=4, keep_ckpts=3, batch_size=16,
               crop="pad", crop_pad=2, flip=True, **{"data.stream_workers": 2, "data.shuffle_buffer": 8})
    full = train(cfg, verbose=False)
    assert full["train_examples"] == 48 and full["steps"] == 8  # 8 steps of 16: over two and a half epochs
    ckpts = list_checkpoints(f"{cfg.run.out}/checkpoints")
    uninterrupted = load_checkpoint(ckpts[-1])
    assert uninterrupted["stream"]["kind"] == "stream"
    positions = uninterrupted["stream"]["ranks"][0]
    assert sum(consumed for _, consumed in positions) > 0 and max(e for e, _ in positions) >= 2
    shutil.move(str(ckpts[-1]), str(ckpts[-1]) + ".bak")  # as if the run died after step 4
    resumed = train(cfg, resume=True, verbose=False)
    again = load_checkpoint(ckpts[-1])
    assert resumed["steps"] == 8
    for k, v in uninterrupted["model"].items():
        assert torch.equal(v, again["model"][k]), k
    assert uninterrupted["stream"] == again["stream"]


def test_a_streamed_runs_shards_packed_again_since_are_refused_by_eval_and_resume(tiny, shard_set, tmp_path):
    """Shards packed again with another seed under the same names, as many samples to a shard: eval of the run
    (which compared nothing for a streamed run) scored held-out shards holding images the run had trained on
    as its held-out ones, and --resume (which compared the counts of units and samples) went on over other
    shards with the checkpoint's positions.  The held-out shards' images are named (the training shards',
    never decoded, by ``units_key``)."""
    from vitlab.data.labelled import load_held_out
    from vitlab.train.legacy import recorded_section

    cfg = tiny("run", data=str(shard_set), val_split=12, steps=2, batch_size=8, cache_dir=str(tmp_path / "cache"),
               **{"data.stream_workers": 0})
    summary = train(cfg, verbose=False)
    assert summary["split_key"]["train"].startswith("36-") and summary["split_key"]["held_out"].startswith("12-")
    run = recorded_section(json.loads((tmp_path / "run" / "config.json").read_text()), "data")
    assert len(load_held_out(run, 8, pool=False, results=summary, run_name="R").held) == 12
    pack_shards(tmp_path / "folder", tmp_path / "again", samples_per_shard=6, seed=1)
    for packed in (tmp_path / "again").iterdir():
        shutil.copyfile(packed, shard_set / packed.name)
    for pool in (False, True):  # eval's, fewshot's
        with pytest.raises(ValueError, match=r"R: its data .*shards changed since it trained \(now training 36 "
                                             r"examples, .*; held-out 12 examples, as many as the run's but not all "
                                             r"the same images\)"):
            load_held_out(run, 8, pool=pool, results=summary, run_name="R")
    with pytest.raises(ConfigError, match=r"^--resume: the data changed since the checkpoint \(now training 36 "
                                          r"examples, .*; held-out 12 examples, as many as the checkpoint's but not "
                                          r"all the same images\)"):
        train(cfg, resume=True, verbose=False)


def test_a_streamed_runs_training_shards_packed_again_are_refused_by_resume_and_eval(tiny, shard_set, tmp_path):
    """A streamed run's training shards are keyed too (``units_key``: each shard's name, byte size and what
    its index records of it, sha256 included; nothing read): shards packed again with another seed under the
    same names, of a run that held none out, were resumed without a word, the checkpoint's positions going on
    over other images; an image of a training shard swapped and the set packed again, the held-out shards
    the same, was resumed and evaluated as the run's data."""
    cfg = tiny("run", data=str(shard_set), val_split=0, steps=2, batch_size=8, cache_dir=str(tmp_path / "cache"),
               **{"data.stream_workers": 0})
    summary = train(cfg, verbose=False)
    assert summary["split_key"]["train"].startswith("48-") and summary["split_key"]["held_out"] is None
    pack_shards(tmp_path / "folder", tmp_path / "again", samples_per_shard=6, seed=1)
    for packed in (tmp_path / "again").iterdir():
        shutil.copyfile(packed, shard_set / packed.name)
    with pytest.raises(ConfigError, match=r"^--resume: the data changed since the checkpoint \(now training 48 "
                                          r"examples, as many as the checkpoint's but not all the same images\)"):
        train(cfg, resume=True, verbose=False)

    held = tiny("held", data=str(shard_set), val_split=12, steps=2, batch_size=8, cache_dir=str(tmp_path / "cache"),
                **{"data.stream_workers": 0})
    summary = train(held, verbose=False)
    assert summary["split_key"]["train"].startswith("36-")
    from vitlab.data.labelled import load_held_out
    from vitlab.data.sources import scan_image_folder
    from vitlab.data.stream import hold_out, open_source
    from vitlab.train.legacy import recorded_section

    # an image of a training shard swapped for another, the set packed again as it was (seed 1), index and all
    trained = {Path(p).name for p in hold_out(open_source(str(shard_set)), 12, 0)[0].units}
    index = scan_image_folder(tmp_path / "folder")
    order = np.random.Generator(np.random.PCG64(1)).permutation(len(index))
    swapped = next(index.paths[i] for place, i in enumerate(order) if f"shard-{place // 6:06d}.tar" in trained)
    Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(swapped)
    shutil.rmtree(tmp_path / "again")
    pack_shards(tmp_path / "folder", tmp_path / "again", samples_per_shard=6, seed=1)
    for packed in (tmp_path / "again").iterdir():
        shutil.copyfile(packed, shard_set / packed.name)
    with pytest.raises(ConfigError, match=r"now training 36 examples, as many as the checkpoint's but not all"):
        train(held, resume=True, verbose=False)
    run = recorded_section(json.loads((tmp_path / "held" / "config.json").read_text()), "data")
    with pytest.raises(ValueError, match=r"now training 36 examples, as many as the run's but not all"):
        load_held_out(run, 8, pool=False, results=summary, run_name="R")  # its held-out shards are as they were


def test_stream_choice_and_refusals(tiny, shard_set, tmp_path):
    with pytest.raises(ConfigError, match="data.train_examples"):
        train(tiny("a", data=str(shard_set), val_split=0, train_examples=10), verbose=False)
    # groups of batches augmented in one call are made from data held in memory
    with pytest.raises(ConfigError, match="data.augment_batches=2: groups batches of data held in memory"):
        train(tiny("a", data=str(shard_set), val_split=0, **{"data.augment_batches": 2}), verbose=False)
    # shards decoded into memory on request: an in-memory run, with a stratified split
    summary = train(tiny("b", data=str(shard_set), val_split=6, steps=2, cache_dir=str(tmp_path / "cache"),
                         **{"data.stream": "memory"}), verbose=False)
    assert summary["train_examples"] == 42 and summary["val_examples"] == 6
    assert "kind" not in load_checkpoint(list_checkpoints(tmp_path / "b" / "checkpoints")[-1])["stream"]
    # a folder whose decoded size exceeds memory_limit_gb is streamed, not decoded into memory
    folder = write_folder(tmp_path / "big", classes=2, per_class=300)
    cfg = tiny("c", data=str(folder), val_split=0, steps=2, **{"data.memory_limit_gb": 1e-6, "data.stream_workers": 1})
    summary = train(cfg, verbose=False)
    assert summary["train_examples"] == 600
    state = load_checkpoint(list_checkpoints(tmp_path / "c" / "checkpoints")[-1])
    assert state["stream"]["kind"] == "stream"


def test_streamed_set_holds_out_whole_shards_and_states_what_it_resolved(tiny, shard_set, tmp_path):
    from vitlab.data.stream import hold_out, open_source

    cfg = tiny("run", data=str(shard_set), val_split=12, split_seed=3, steps=4, batch_size=8, eval_every=2,
               cache_dir=str(tmp_path / "cache"))
    summary = train(cfg, verbose=False)
    assert summary["train_examples"] == 36 and summary["val_examples"] == 12  # two shards of 6 held out
    assert summary["val_top1"] is not None and 0.0 <= summary["data_wait"] < 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["data_wait"] < 1.0 for r in records)
    # the run's config.json states the values "auto" took on this machine
    data = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert data["stream"] == "stream" and data["stream_workers"] == max(0, min(Machine.here().cores - 1, 6))
    assert isinstance(data["decode_workers"], int)
    # the held-out shards are a seeded choice, never read for training
    train_part, held = hold_out(open_source(str(shard_set)), 12, 3)
    assert held.num_samples == 12 and not set(map(str, held.units)) & set(map(str, train_part.units))
    assert hold_out(open_source(str(shard_set)), 12, 3)[1].units == held.units != hold_out(
        open_source(str(shard_set)), 12, 4)[1].units


@pytest.mark.parametrize("accum", ["estimated", "resumed"])
def test_the_stream_workers_a_run_records_are_the_ones_its_loader_runs(tiny, shard_set, monkeypatch, accum):
    # Each reader makes a part of every micro-batch, so a micro-batch of 2 feeds 2 workers. The workers were
    # decided for a micro-batch of the whole batch (accum_steps "auto" not yet decided, or a resumed run's not
    # yet taken), so the run's line, config.json and checkpoints said 7 where its loader ran 2
    from vitlab.train import resolve as resolve_module
    from vitlab.train.build import build
    from vitlab.train.distributed import World

    saved = None
    if accum == "estimated":  # the memory estimate chooses 4 micro-batches of 2
        monkeypatch.setattr(resolve_module, "smallest_fitting_accum", lambda shape, batch, available: 4)
    else:
        saved = {"accum_steps": 4}
    cfg = tiny("run", data=str(shard_set), val_split=0, batch_size=8,
               **{"optim.accum_steps": "auto", "data.stream_workers": "auto"})
    setup = build(cfg, World(0, 1, 0, torch.device("cpu")), Machine.described(cores=8), saved=saved)
    assert setup.resolved.micro_batch == 2 and setup.resolved.accum_steps == 4
    assert setup.stream.workers == 2 == setup.resolved.stream_workers == setup.cfg.data.stream_workers
    assert "data stream (2 stream workers)" in setup.resolved.line()
    assert setup.resolved.memory.shape.stream_workers == 2  # and the memory recorded is that of 2


def test_a_cut_shard_counts_its_lost_images_in_the_summary_streamed_or_in_memory(tiny, shard_set, tmp_path, caplog):
    from vitlab.data.shards import read_shard

    cut = shard_set / "shard-000002.tar"
    cut.write_bytes(cut.read_bytes()[:3000])  # of its 6 samples, what precedes the cut is read
    lost = 6 - sum(1 for _ in read_shard(cut, []))
    assert lost > 0
    cfg = tiny("stream", data=str(shard_set), val_split=0, steps=2, batch_size=16, ckpt_every=2,
               **{"data.stream_workers": 2})
    with caplog.at_level("WARNING"):
        summary = train(cfg, verbose=False)  # one batch: each worker reads all of its four shards
    assert summary["train_examples"] == 48 and summary["skipped_images"] == lost
    assert f"{cut}: {lost} of its 6 images could not be read" in caplog.text
    state = load_checkpoint(list_checkpoints(tmp_path / "stream" / "checkpoints")[-1])
    assert [where for where, *_ in state["stream"]["unread"]] == [str(cut)]  # a resumed run goes on counting it
    summary = train(tiny("memory", data=str(shard_set), val_split=6, steps=2, cache_dir=str(tmp_path / "cache"),
                         **{"data.stream": "memory"}), verbose=False)
    assert summary["skipped_images"] == lost and summary["train_examples"] + summary["val_examples"] == 48 - lost


def test_a_separate_validation_set(tiny, shard_set, tmp_path):
    val = write_folder(tmp_path / "val", classes=3, per_class=4)
    summary = train(tiny("run", data=str(shard_set), val_split=0, steps=2, cache_dir=str(tmp_path / "cache"),
                         **{"data.val_data": str(val)}), verbose=False)
    assert summary["val_examples"] == 12 and summary["train_examples"] == 48
    with pytest.raises(ConfigError, match="data.val_data"):
        tiny("both", data=str(shard_set), val_split=6, **{"data.val_data": str(val)})
    other = write_folder(tmp_path / "other", classes=3, per_class=2)
    (other / "c1").rename(other / "c3")  # a class the training set lacks
    with pytest.raises(ConfigError, match="its classes are not the training set's, it lacks 'c1'; it adds 'c3'; each"):
        train(tiny("mismatch", data=str(shard_set), val_split=0, steps=2, cache_dir=str(tmp_path / "cache"),
                   **{"data.val_data": str(other)}), verbose=False)


def test_how_two_class_lists_differ_is_said():
    from vitlab.train.inputs import class_difference

    assert class_difference(["a", "b"], ["a", "b", "c"]) == "it lacks 'c'"
    assert class_difference(["a", "b", "x"], ["a", "b"]) == "it adds 'x'"
    assert class_difference(["a", "y"], ["a", "b"]) == "it lacks 'b'; it adds 'y'"
    assert class_difference(["b", "a", "c"], ["a", "b", "c"]) == \
        "the same 3 names in another order (class 0 is 'b', not 'a')"
    assert class_difference([], [str(i) for i in range(7)]).endswith("'4' and 2 more")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_two_processes_stream_shards(tmp_path, shard_set, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vitlab",
            "train", "--recipe", "demo", "--data", str(shard_set / "shard-{000000..000007}.tar"), "--val-split", "0",
            "--steps", "4", "--batch-size", "16", "--img-size", "8", "--out", str(tmp_path / "run"), "--quiet",
            "--set", "model.patch_size=4", "--set", "model.width=16", "--set", "model.depth=1",
            "--set", "model.num_heads=2", "--set", "model.mlp_dim=32", "--set", "run.threads=1",
            "--set", "run.eval_every=0", "--set", "run.tensorboard=false", "--set", "data.stream_workers=2",
            "--stream", "stream"] + (["--fsdp"] if mode == "fsdp" else [])
    t = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["train_examples"] == 48
    state = load_checkpoint(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    ranks = state["stream"]["ranks"]
    assert len(ranks) == 2 and all(len(r) == 2 for r in ranks)
    # each rank: 4 steps x 8 = 32 samples from its 2 readers, which hold 2 shards x 6 = 12 samples an epoch
    assert all(sum(12 * epoch + consumed for epoch, consumed in r) == 32 for r in ranks), ranks
    print(f"torchrun {mode} 2 x 2 workers: {time.monotonic() - t:.1f} s")


@pytest.mark.slow
def test_torchrun_the_cifar_recipe_on_shards_with_a_held_out_split(tmp_path):
    # the command of issue 42: torchrun --nproc_per_node=2 -m vitlab train --recipe cifar10_scratch:model=vit
    # --data SHARDS, with the recipe's held-out split (whole shards) scaled to this tiny set
    pack_shards(write_folder(tmp_path / "folder", size=32), tmp_path / "shards", samples_per_shard=6)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vitlab",
            "train", "--recipe", "cifar10_scratch:model=vit", "--data", str(tmp_path / "shards"), "--val-split", "12",
            "--steps", "2", "--batch-size", "16", "--out", str(tmp_path / "run"), "--quiet",
            "--set", "run.time_limit=0", "--set", "run.precision=fp32", "--set", "run.threads=1",
            "--set", "run.tensorboard=false", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert summary["train_examples"] == 36 and summary["val_examples"] == 12 and summary["val_top1"] is not None
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["stream"] == "stream" and isinstance(config["data"]["stream_workers"], int)


@pytest.mark.slow
def test_two_processes_equal_one_on_streamed_shards(tmp_path, shard_set):
    # The global batch is a function of the readers (world_size x stream_workers = 2 in both
    # runs), each reader's part augmented with its own seed: one process of two workers and
    # two processes of one worker train on the same batches, so SGD gives the same weights.
    from vitlab.weights import load_model

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    common = ["train", "--recipe", "demo", "--data", str(shard_set), "--val-split", "0", "--steps", "3",
              "--batch-size", "16", "--img-size", "8", "--quiet", "--set", "optim.optimizer=sgd",
              "--set", "optim.lr=0.1", "--set", "optim.weight_decay=0", "--set", "augment.crop=pad",
              "--set", "augment.flip=true", "--set", "model.patch_size=4", "--set", "model.width=16",
              "--set", "model.depth=1", "--set", "model.num_heads=2", "--set", "model.mlp_dim=32",
              "--set", "run.threads=1", "--set", "run.eval_every=0", "--set", "run.tensorboard=false"]
    launchers = {"one": ([sys.executable, "-m", "vitlab"], 2),
                 "two": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "vitlab"], 1)}
    weights = {}
    for name, (launcher, workers) in launchers.items():
        done = subprocess.run(launcher + common + ["--out", str(tmp_path / name), "--set",
                                                   f"data.stream_workers={workers}"],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
        assert summary["world_size"] == {"one": 1, "two": 2}[name]
        weights[name] = load_model(summary["weights"]).state_dict()
    for k, v in weights["one"].items():
        torch.testing.assert_close(v, weights["two"][k], rtol=1e-5, atol=1e-6, msg=k)


def test_training_on_a_hugging_face_dataset_with_a_held_out_part(tiny, tmp_path):
    datasets = pytest.importorskip("datasets", reason='the hf extra: pip install -e ".[hf]"')
    folder = write_folder(tmp_path / "folder")
    images = [Image.open(p).convert("RGB") for c in range(3) for p in sorted((folder / f"c{c}").iterdir())]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["r", "g", "b"])})
    labelled = datasets.Dataset.from_dict({"img": images, "label": [i // 16 for i in range(48)]}, features=features)
    labelled.save_to_disk(str(tmp_path / "ds"), num_shards=3)  # three arrow files of one record batch each
    summary = train(tiny("run", data=str(tmp_path / "ds"), val_split=16, steps=2, crop="pad", crop_pad=2,
                         cache_dir=str(tmp_path / "cache")), verbose=False)
    assert summary["train_examples"] == 32 and summary["val_examples"] == 16 and summary["val_top1"] is not None


def test_a_multi_label_validation_set_is_scored_by_precision_at_1_in_training_and_in_eval(tiny, tmp_path, capsys):
    # JFT-style held-out shards were scored against each image's first label, as val_top1 (eval's top-1 too): a
    # top-1 class that was another of the image's labels counted as an error, and val_loss took the first alone
    from helpers.multi_label import multi_label_shard
    from vitlab.cli import main
    from vitlab.data.memory import load_source_in_memory
    from vitlab.data.stream import hold_out, open_source
    from vitlab.eval.features import predict_logits
    from vitlab.train.metrics import read_jsonl
    from vitlab.weights import load_model

    labels = ["0,2", "1", "3,1,0", "2", "1,3", "0"]  # every shard's, in its order
    shards = multi_label_shard(tmp_path / "jft", labels * 4, per_shard=6)
    cfg = tiny("run", data=str(shards), val_split=6, steps=3, batch_size=6, loss="sigmoid_xent", tensorboard=False,
               cache_dir=str(tmp_path / "cache"), **{"data.stream_workers": 1})
    summary = train(cfg)
    held = load_source_in_memory(hold_out(open_source(str(shards)), 6, 0)[1], (8, 8), tmp_path / "again", workers=1)
    logits = torch.from_numpy(predict_logits(load_model(summary["weights"]).eval(), held.images)).double()
    hot = torch.zeros(6, 4, dtype=torch.double)  # every label of each image
    for row, ids in enumerate(labels):
        hot[row, [int(i) for i in ids.split(",")]] = 1
    assert summary["val_prec1"] == pytest.approx(hot.gather(1, logits.argmax(1, keepdim=True)).mean().item())
    assert "val_top1" not in summary and "val_top5" not in summary  # no image has one label to count them against
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, hot, reduction="none").sum(1).mean()
    assert summary["val_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert f"step 3: val prec@1 {summary['val_prec1']:.4f} loss " in capsys.readouterr().err
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["val_prec1"] == summary["val_prec1"]
    # `vitlab eval` of the run scores its held-out shards the same way, and says so
    assert main(["eval", "--checkpoint", summary["weights"], "--cache-dir", str(tmp_path / "cache")]) == 0
    assert f"prec@1 {100 * summary['val_prec1']:.2f}% (multi-label" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", summary["weights"], "--json", "--cache-dir", str(tmp_path / "cache")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prec1"] == pytest.approx(summary["val_prec1"]) and out["n"] == 6 and "top1" not in out
