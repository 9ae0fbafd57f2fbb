"""`vitlab train` end to end: a synthetic ImageFolder, one process and two (torchrun, gloo)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.weights import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.img_size=16", "--set", "model.patch_size=8", "--set", "model.width=16",
        "--set", "model.depth=1", "--set", "model.num_heads=2", "--set", "model.mlp_dim=32", "--set", "run.threads=1",
        "--set", "run.eval_every=0", "--set", "run.tensorboard=false", "--set", "data.decode_workers=0", "--quiet"]


def make_image_folder(root: Path, classes=("cat", "dog", "fish"), per_class=12) -> Path:
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (16, 16, 3), dtype=np.uint8)
            pixels[:, :, c] += 150  # each class has its own dominant colour
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    (root / "dog" / "broken.png").write_bytes(b"not a png")  # must be skipped and counted, not fatal
    return root


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def summary_fields_the_docs_name() -> set[str]:
    """The fields docs/training.md's "The run's summary" names (a CPU run's; the GPU's MFU fields follow it)."""
    text = (ROOT / "docs" / "training.md").read_text().split("## The run's summary", 1)[1]
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", text.split("On a GPU it also gives", 1)[0]))


def test_train_cli_end_to_end(tmp_path, capsys):
    data = make_image_folder(tmp_path / "images")
    out = tmp_path / "run"
    code = main(["train", "--recipe", "demo", "--data", str(data), "--val-split", "6", "--steps", "6",
                 "--batch-size", "8", "--out", str(out), "--set", f"data.cache_dir={tmp_path / 'cache'}", *TINY])
    assert code == 0
    summary = last_json_line(capsys.readouterr().out)
    assert summary["steps"] == 6 and summary["val_examples"] == 6 and summary["skipped_images"] == 1
    assert 0 <= summary["val_top1"] <= 1 and summary["val_top5"] == 1.0  # 3 classes: top-5 always hits
    model = load_model(summary["weights"])
    assert model.cfg.num_classes == 3
    assert json.loads((out / "classes.json").read_text()) == ["cat", "dog", "fish"]
    for name in ("metrics.jsonl", "metrics.csv", "summary.json", "config.json", "curves.png"):
        assert (out / name).is_file(), name
    assert json.loads((out / "summary.json").read_text()) == summary
    assert set(summary) <= summary_fields_the_docs_name()
    # predict reads the weights and the class names beside them
    assert main(["predict", "--checkpoint", summary["weights"], "--json", str(data / "cat" / "0.png")]) == 0
    top = json.loads(capsys.readouterr().out.splitlines()[-1])["top"]
    assert len(top) == 3 and {t["class"] for t in top} == {"cat", "dog", "fish"}


def test_train_cli_refuses_bad_config_before_work(tmp_path, capsys):
    code = main(["train", "--recipe", "demo", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")])
    assert code == 2
    assert "data.source=" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    assert main(["train", "--recipe", "demo", "--set", "optim.batch_size=10", "--set", "optim.accum_steps=3"]) == 2
    assert "batch_size=10" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("kept")  # --out naming a file: refused, the file left as it was
    assert main(["train", "--recipe", "demo", "--steps", "2", "--out", str(tmp_path / "a-file")]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab train: error: run.out={str(tmp_path / 'a-file')!r} is a file; "
                                              "expected a folder (a new one, or a run's)")
    assert (tmp_path / "a-file").read_text() == "kept"
    # a sweep's runs lie under its --out, an experiment's under its own: each refused before its first run
    assert main(["sweep", "--recipe", "demo", "--grid", "0.01", "--steps", "2", "--out", str(tmp_path / "a-file")]) == 2
    run_out, a_file = str(tmp_path / "a-file" / "lr_0.01"), str(tmp_path / "a-file")
    assert capsys.readouterr().err.strip() == (f"vitlab sweep: error: run.out={run_out!r} lies under {a_file!r}, "
                                              "a file; expected a folder (a new one, or a run's)")
    assert main(["experiment", "head", "--steps", "2", "--out", str(tmp_path / "a-file")]) == 2
    assert f"out={str(tmp_path / 'a-file')!r} is a file" in capsys.readouterr().err
    assert (tmp_path / "a-file").read_text() == "kept"
    # a held-out split that leaves no training image is named by its field (the library said "val_size")
    assert main(["train", "--recipe", "demo", "--val-split", "1797", "--steps", "2", "--out", str(tmp_path / "v")]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab train: error: data.val_split=1797: takes 1797 of the 1797 "
                                              "examples; it must leave some on either side (1 to 1796, or a fraction "
                                              "in (0, 1))")
    assert main(["sweep", "--recipe", "demo", "--grid", "0.01,abc", "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab sweep: error: --grid '0.01,abc': expected comma-separated "
                                              "learning rates, e.g. 0.001,0.003,0.01")
    # a rate given twice met its own run's folder (lr_0.1) and was refused after the first run
    assert main(["sweep", "--recipe", "demo", "--grid", "0.1,0.10", "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab sweep: error: --grid=(0.1, 0.1): 0.1 given more than once; "
                                              "each rate is one run")
    # two rates whose folders are spelt alike (lr_0.001): the second met the first's run
    assert main(["sweep", "--recipe", "demo", "--grid", "0.001,0.0010000001", "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab sweep: error: --grid=(0.001, 0.0010000001): 0.001 given more "
                                              "than once; each rate is one run")
    assert not (tmp_path / "s").exists()
    # nothing held out leaves the grid nothing to be compared on: a TypeError on the first rate's
    # missing score, after its run
    assert main(["sweep", "--recipe", "demo", "--grid", "0.1", "--holdout", "0", "--steps", "1", "--out",
                 str(tmp_path / "s"), *TINY]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab sweep: error: --holdout 0: the grid is compared on a held-out "
                                              "part of the training set; give a count (500) or a fraction (0.1)")
    assert not (tmp_path / "s").exists()
    # vtab reads --grid as sweep does, before its tasks ("abc" was float's "could not convert string to float")
    assert main(["vtab", "--init", str(tmp_path / "w"), "--tasks", str(tmp_path / "t"), "--grid", "abc"]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab vtab: error: --grid 'abc': expected comma-separated "
                                              "learning rates, e.g. 0.001,0.003,0.01")


def test_an_init_named_as_a_model_is_named_so_before_any_work(tmp_path, capsys, monkeypatch):
    """--init given a registry name (or one mistyped) was "model.init='ViT-B/17': no such file or folder",
    where load_model and export name the model it resembles; a valid one said nothing of what it is."""
    from vitlab.models.registry import list_models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["--data", "digits", "--steps", "1", "--out", str(tmp_path / "o")]
    assert main(["finetune", "--init", "ViT-B/17", *base]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitlab finetune: error: model.init='ViT-B/17': no such file or folder, and unknown model 'ViT-B/17'. "
        "Did you mean 'ViT-B/16' or 'ViT-B/14' or 'ViT-B/8'? `vitlab models` lists all "
        f"{len(list_models())} names.")
    assert main(["sweep", "--recipe", "demo", "--grid", "0.1", "--init", "ViT-B_16", *base]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitlab sweep: error: model.init='ViT-B_16': names a model of the registry, not weights, and is no file or "
        "folder; a fine-tune starts from weights (a file or folder, such as a run's model.safetensors, or a Hugging "
        "Face Hub name org/name); to train ViT-B/16 from scratch, name it as the model, without an init (vitlab train "
        "--model ViT-B/16)")
    assert main(["finetune", "--init", "missing.npz", *base]) == 2  # a file that is not there: as before
    assert capsys.readouterr().err.strip() == "vitlab finetune: error: model.init='missing.npz': no such file or folder"
    assert not (tmp_path / "o").exists()


def test_an_output_folder_inside_the_image_folder_is_refused(tmp_path, capsys, monkeypatch):
    """`cd pets && vitlab train --data .` wrote runs/demo into the data: the next run on it trained on a class
    'runs' (curves.png its image) without a word, and eval of the first met a class it never had."""
    data = make_image_folder(tmp_path / "imgs")
    monkeypatch.chdir(data)
    base = ["train", "--recipe", "demo", "--steps", "1", "--batch-size", "9", "--val-split", "6", *TINY]
    for flags, out, given in (([], "runs/demo", "."), (["--out", str(data / "cat" / "x")], str(data / "cat" / "x"),
                                                       str(data))):
        assert main([*base, "--data", given, *flags]) == 2
        assert capsys.readouterr().err.strip() == (
            f"vitlab train: error: run.out={out!r} lies inside data.source={given!r} (--data), an image folder: the "
            "run's files would be read as the data's (its curves.png an image) by the next run, eval or --resume on "
            "it; choose an --out outside the data's folder")
    assert sorted(p.name for p in data.iterdir()) == ["cat", "dog", "fish"]
    assert main([*base, "--data", ".", "--out", str(tmp_path / "run")]) == 0  # beside it


def test_a_fine_tune_into_its_inits_folder_is_refused_and_the_init_kept(tmp_path, capsys, tiny_checkpoint):
    """finetune --init runs/pre --out runs/pre --overwrite wrote over the weights it started from (and, since
    --overwrite removes an earlier run's weights as it starts, lost them to an interrupted run)."""
    import shutil

    pre = tmp_path / "pre"
    shutil.copytree(tiny_checkpoint, pre)
    kept = {p.name: p.read_bytes() for p in pre.iterdir()}
    for init in (str(pre), str(pre / "model.safetensors")):
        assert main(["finetune", "--init", init, "--out", str(pre), "--overwrite", "--data", "digits", "--steps", "1",
                     "--set", "run.threads=1", "--quiet"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"vitlab finetune: error: model.init={init!r}: the weights run.out={str(pre)!r} holds, which this run "
            "writes its own over; fine-tune them into another --out")
    assert {p.name: p.read_bytes() for p in pre.iterdir()} == kept


def test_an_empty_data_folder_is_named_before_the_output_folder(tmp_path, capsys, monkeypatch):
    from vitlab.config import ConfigError
    from vitlab.train import train
    from vitlab.train.checkpoint import checkpoint_path

    monkeypatch.chdir(tmp_path)
    checkpoint_path(tmp_path / "runs" / "demo" / "checkpoints", 10).parent.mkdir(parents=True)
    checkpoint_path(tmp_path / "runs" / "demo" / "checkpoints", 10).write_bytes(b"an earlier run's")
    (tmp_path / "empty").mkdir()
    (tmp_path / "classes" / "cat").mkdir(parents=True)
    (tmp_path / "classes" / "dog").mkdir()
    (tmp_path / "classes" / "dog" / "notes.txt").write_text("no image")
    for folder, what in (("empty", "the folder holds no data"), ("classes", "its 2 class folder(s) hold no images")):
        assert main(["train", "--recipe", "demo", "--data", folder]) == 2  # the default --out: runs/demo
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"vitlab train: error: data.source='{folder}' (--data): {what}; it takes an ImageFolder")
        assert len(err.splitlines()) == 1 and "checkpoints" not in err
    assert main(["train", "--recipe", "demo", "--data", "digits", "--val-data", "empty"]) == 2
    assert "data.val_data='empty' (--val-data): the folder holds no data" in capsys.readouterr().err
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import with_changes

    with pytest.raises(ConfigError, match="data.source='empty' .*holds no data"):  # the library: the same order
        train(with_changes(load_recipe("demo"), {"data.source": "empty"}), verbose=False)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no folder can be made")
def test_an_unwritable_output_folder_is_refused_before_the_data_is_decoded(tmp_path, capsys, monkeypatch):
    # it failed at the first write, once the data was decoded and the model built, with a bare
    # "[Errno 2] No such file or directory: '/proc/x'" (root passes any permission check: /proc does not)
    import vitlab.train.inputs as inputs

    def no_decoding(*args, **kwargs):
        raise AssertionError("the data was decoded before the output folder was checked")

    monkeypatch.setattr(inputs, "load_labelled", no_decoding)
    assert main(["train", "--recipe", "demo", "--steps", "2", "--out", "/proc/x/run", *TINY]) == 2
    err = capsys.readouterr().err.strip()  # the reason is the OS's: "No such file or directory" as root
    assert err.startswith("vitlab train: error: run.out='/proc/x/run': nothing can be written in '/proc' (")
    assert err.endswith("); expected a writable folder") and len(err.splitlines()) == 1


def test_resume_and_overwrite_together_are_refused_and_the_run_is_kept(tmp_path, capsys):
    # --resume won and --overwrite was dropped without a word: a run meant to start afresh continued
    from vitlab.train.checkpoint import checkpoint_path

    kept = checkpoint_path(tmp_path / "run" / "checkpoints", 10)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"an earlier run's")
    for command in (["train"], ["sweep", "--grid", "0.01"]):
        assert main([*command, "--recipe", "demo", "--steps", "2", "--out", str(tmp_path / "run"), "--resume",
                     "--overwrite", *TINY]) == 2
        assert capsys.readouterr().err.strip() == (
            f"vitlab {command[0]}: error: resume=True and overwrite=True (--resume, --overwrite): one continues the run "
            "in run.out, the other deletes its checkpoints and starts afresh; give one of them")
    assert kept.read_bytes() == b"an earlier run's"


def test_the_weights_of_a_run_that_kept_no_checkpoints_are_not_written_over(tmp_path, capsys):
    # only the checkpoints were looked for: a run without them (run.ckpt_every=0, or removed by hand)
    # lost its model.safetensors to the next run into the same folder
    kept = tmp_path / "run" / "model.safetensors"
    kept.parent.mkdir()
    kept.write_bytes(b"an earlier run's")
    command = ["train", "--recipe", "demo", "--steps", "2", "--out", str(kept.parent), *TINY]
    assert main(command) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab train: error: run.out='{kept.parent}' holds the weights of an earlier run; start afresh there "
        "with --overwrite, or choose another --out")
    assert kept.read_bytes() == b"an earlier run's"
    # --resume found no checkpoint to continue, trained from step 0 and wrote over the weights
    assert main(command + ["--resume"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab train: error: --resume: run.out='{kept.parent}' holds the weights of an earlier run and no checkpoint "
        "to continue it from (a finished run's were removed); start afresh there with --overwrite, or choose "
        "another --out")
    assert kept.read_bytes() == b"an earlier run's"
    assert main(command + ["--overwrite"]) == 0
    assert kept.read_bytes() != b"an earlier run's"


def test_one_class_is_refused_before_a_model_is_built(tmp_path, capsys):
    # with one class every prediction is right: the run would report 100% having learned nothing
    data = tmp_path / "images"
    make_image_folder(data, classes=("cat", "dog"), per_class=6)
    for path in (data / "dog").iterdir():
        path.unlink()
    (data / "dog").rmdir()
    out = tmp_path / "run"
    assert main(["train", "--recipe", "demo", "--data", str(data), "--val-split", "2", "--batch-size", "2",
                 "--steps", "1", "--out", str(out), *TINY]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab train: error: data.source={str(data)!r} (--data): it has 1 class ('cat'); training a classifier "
        "needs at least 2 class folders (FOLDER/CLASS/IMAGE)")
    assert not out.exists()
    # a subset of one class: named by its field
    assert main(["train", "--recipe", "demo", "--data", "digits", "--set", "data.class_subset=('3',)",
                 "--val-split", "10", "--batch-size", "4", "--steps", "1", "--out", str(out), *TINY]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab train: error: data.class_subset=('3',): keeps 1 class ('3'); "
                                              "training a classifier needs at least 2")
    assert not out.exists()


def test_demo_smoke(tmp_path, capsys):
    assert main(["demo", "--steps", "5", "--out", str(tmp_path / "demo"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "validation accuracy" in out
    assert load_model(last_json_line(out)["weights"]).cfg.num_classes == 10


def test_demo_replaces_its_own_folder_but_not_another_runs(tmp_path, capsys):
    """The demo starts afresh in its folder each time; given a `train` run's folder as --out, it
    deleted that run's checkpoints and wrote over its weights without a word."""
    data = make_image_folder(tmp_path / "images", per_class=4)
    run = tmp_path / "run"
    assert main(["train", "--recipe", "demo", "--data", str(data), "--val-split", "3", "--batch-size", "4",
                 "--steps", "1", "--out", str(run), *TINY]) == 0
    capsys.readouterr()
    weights = (run / "model.safetensors").read_bytes()
    assert main(["demo", "--steps", "1", "--out", str(run), "--quiet", "--no-report", *TINY[:-1]]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab demo: error: run.out='{run}' holds the checkpoints of a 'demo' run on '{data}'; the demo recipe on "
        "'digits' starts afresh only in a new folder or one of its own: choose another --out")
    assert (run / "model.safetensors").read_bytes() == weights and (run / "checkpoints" / "ckpt-00000001.pt").exists()
    demo = ["demo", "--steps", "1", "--out", str(tmp_path / "demo"), "--quiet", "--no-report", *TINY[:-1]]
    assert main(demo) == 0 and main(demo) == 0  # its own folder: replaced


def _run_cli(args, env_extra=None, torchrun=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    launcher = [sys.executable, "-m", "vitlab"]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                    "-m", "vitlab"]
    done = subprocess.run(launcher + args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return last_json_line(done.stdout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("launch, said", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 (environment) without RANK: each of the 2 processes needs its own rank"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 (environment): a rank of WORLD_SIZE=2 process(es) is 0 to 1"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' (environment): expected an integer >= 1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' (environment): expected an integer >= 1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "port"}, "MASTER_PORT='port' (environment): expected an integer"),
    ({"LOCAL_RANK": "first"}, "LOCAL_RANK='first' (environment): expected an integer >= 0"),
])
def test_a_launch_by_hand_of_wrong_variables_is_refused_in_one_line_before_any_group_is_joined(tmp_path, launch, said):
    """A process started with WORLD_SIZE=2 and no RANK took rank 0, as its peer did, and one of RANK=2 was never
    met: each waited in the rendezvous for the backend's half hour; WORLD_SIZE='two' failed with a traceback in
    the error's own printing, WORLD_SIZE=0 as a division by zero, and a port or local rank of another form as
    "invalid literal for int()", naming no variable."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), **launch}
    try:
        done = subprocess.run([sys.executable, "-m", "vitlab", "train", "--recipe", "demo", "--data", "digits",
                               "--steps", "1", "--batch-size", "16", "--out", str(tmp_path / "run"), *TINY],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{launch}: the process waited for ranks that never came")
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"vitlab train: error: {said}"), lines
    assert "torchrun" in lines[0] and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, capsys):
    # SGD, no dropout, no augmentation: DDP's averaged gradients of two halves of the batch
    # equal the gradient of the whole batch, so the weights agree to float rounding; FSDP's
    # sharded update (reduce-scatter) must agree too.
    data = make_image_folder(tmp_path / "images", per_class=16)
    common = ["train", "--recipe", "demo", "--data", str(data), "--steps", "3", "--batch-size", "16",
              "--val-split", "9", "--set", "optim.optimizer=sgd", "--set", "optim.lr=0.1",
              "--set", "optim.weight_decay=0", "--set", "augment.crop=none",
              "--set", f"data.cache_dir={tmp_path / 'cache'}", *TINY]
    assert main(common + ["--out", str(tmp_path / "one")]) == 0  # also fills the decoded-image cache
    one = last_json_line(capsys.readouterr().out)
    a = load_model(one["weights"]).state_dict()
    for mode in ("ddp", "fsdp"):
        two = _run_cli(common + ["--out", str(tmp_path / mode)] + (["--fsdp"] if mode == "fsdp" else []), torchrun=2)
        assert two["world_size"] == 2 and one["world_size"] == 1
        b = load_model(two["weights"]).state_dict()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=f"{mode}: {k}")
        assert one["val_top1"] == pytest.approx(two["val_top1"])


@pytest.mark.slow
def test_two_processes_train_a_batchnorm_stem_as_one_process_does(tmp_path, capsys):
    """Each process normalised its BatchNorm stem with the statistics of its own half of the batch, and moved
    the running statistics by them: two processes at batch 16 trained another model than one process at 16
    (its first step's gradient norm 0.896 against 0.899, the weights 0.04 apart after 4 steps).  They
    normalise with the whole micro-batch's now, which one process sees."""
    common = ["train", "--recipe", "demo", "--data", "digits", "--steps", "4", "--batch-size", "16", "--val-split",
              "101", *TINY, "--set", "run.log_every=1", "--set", "augment.crop=none", "--set", "model.patch_size=1",
              "--set", 'model.resnet={"layers": [1], "img_size": 16, "norm": "batch"}']
    assert main(common + ["--out", str(tmp_path / "one")]) == 0
    one = last_json_line(capsys.readouterr().out)
    two = _run_cli(common + ["--out", str(tmp_path / "two")], torchrun=2)
    records = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("one", "two")]
    assert [r["step"] for r in records[1]] == [1, 2, 3, 4]
    for a, b in zip(*records):
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-5), a["step"]
    a, b = load_model(one["weights"]).state_dict(), load_model(two["weights"]).state_dict()
    assert any("running_var" in k for k in a)
    for k in a:  # the running statistics too
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_process_evaluation_scores_the_saved_weights(tmp_path, mode):
    """A BatchNorm stem's running statistics are each process's own, moved by its own micro-batches;
    every process scored its share of the held-out examples with its own, and the saved weights hold
    rank 0's: the run reported a val_top1 (0.42) that `vitlab eval` of its weights did not give (0.435)."""
    from vitlab.data.labelled import load_held_out
    from vitlab.eval import Evaluator

    out = tmp_path / mode
    summary = _run_cli(["train", "--recipe", "demo", "--data", "digits", "--steps", "12", "--batch-size", "16",
                        "--val-split", "100", "--out", str(out), *TINY, "--set", "model.patch_size=1",
                        "--set", 'model.resnet={"layers": [1], "img_size": 16, "norm": "batch"}']
                       + (["--fsdp"] if mode == "fsdp" else []), torchrun=2)
    model = load_model(summary["weights"])
    held = load_held_out(json.loads((out / "config.json").read_text())["data"], model.cfg.img_size)
    scored = Evaluator(held.images[held.held], held.labels[held.held]).run(model)
    assert summary["val_loss"] == pytest.approx(scored["loss"], rel=1e-6, abs=0)
    assert summary["val_top1"] == scored["top1"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_checkpoint_of_a_run_without_fsdp_continues_under_fsdp(tmp_path, capsys, optimizer):
    """--resume --fsdp of a one-process (or DDP) run's checkpoint failed with a traceback: a plain
    Adam's state numbers its parameters, FSDP's names them (KeyError: 'state.0.step'), and SGD's groups
    brought fused=True, which has no form for FSDP's shards (NotImplementedError: aten._fused_sgd_).
    No augmentation: the two-process continuation meets the uninterrupted run (no qkv bias: the key's
    gets a gradient of rounding noise only, which Adam scales up to steps of its size)."""
    import shutil

    common = ["train", "--recipe", "demo", "--data", "digits", "--steps", "4", "--batch-size", "16",
              "--val-split", "100", "--set", "augment.crop=none", "--set", "model.qkv_bias=false",
              "--set", f"optim.optimizer={optimizer}",
              "--set", "run.ckpt_every=2", "--set", "run.keep_ckpts=2", *TINY]
    assert main(common + ["--out", str(tmp_path / "one")]) == 0
    one = last_json_line(capsys.readouterr().out)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    (tmp_path / "two" / "checkpoints" / "ckpt-00000004.pt").unlink()  # continued from step 2's
    assert [p.name for p in (tmp_path / "two" / "checkpoints").iterdir()] == ["ckpt-00000002.pt"]
    two = _run_cli(common + ["--out", str(tmp_path / "two"), "--fsdp", "--resume"], torchrun=2)
    assert two["steps"] == 4 and two["world_size"] == 2
    a, b = load_model(one["weights"]).state_dict(), load_model(two["weights"]).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_masked_patch_prediction_trains_in_two_processes(tmp_path):
    """Masked patch prediction leaves the ViT's classifier out, whose parameters get no gradient: under
    DDP, which waits for one of every parameter, the second step stopped with a traceback ("Expected to
    have finished reduction in the prior iteration")."""
    summary = _run_cli(["train", "--recipe", "demo", "--data", "digits", "--steps", "3", "--batch-size", "16",
                        "--val-split", "0", "--set", "model.mpp=color", "--set", "augment.label_smoothing=0",
                        "--out", str(tmp_path / "mpp"), *TINY], torchrun=2)
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert load_model(summary["weights"]).cfg.width == 16


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sweep", "vtab", "experiment"])
def test_a_protocol_of_runs_launched_on_two_processes_is_refused_in_one_line_before_any_work(tmp_path, command,
                                                                                              tiny_checkpoint):
    """A sweep, vtab or an experiment trains its runs one after another: under torchrun every process ran it
    whole, writing its records and reports; a sweep's second run waited for the other process for ever, vtab's
    second process ended in a traceback on the weights rank 0 alone saves."""
    out = tmp_path / "out"
    args = {"sweep": ["sweep", "--recipe", "demo", "--data", "digits", "--grid", "0.01,0.03", "--steps", "2",
                      "--batch-size", "16", *TINY],
            "vtab": ["vtab", "--init", tiny_checkpoint, "--tasks",
                     str(make_image_folder(tmp_path / "tasks" / "cifar100" / "train").parents[1]), "--examples",
                     "20", "--steps", "1", "--batch-size", "8", "--grid", "0.01", "--quiet"],
            "experiment": ["experiment", "head", "--quick", "--seeds", "1"]}[command]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "vitlab", *args, "--out", str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        stdout, stderr = launch.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        launch.terminate()  # torchrun ends its workers on SIGTERM (killed, it left them waiting)
        launch.communicate(timeout=60)
        pytest.fail(f"vitlab {command} on 2 processes: waited for ever")
    said = [line for line in stderr.splitlines() if line.startswith(f"vitlab {command}: ")]
    what = "an experiment" if command == "experiment" else command
    assert launch.returncode != 0 and said == [
        f"vitlab {command}: error: WORLD_SIZE=2 (environment): {what} runs its runs one after another in one process, and under torchrun every process ran it whole; run it "
        "without torchrun, or train one run on several processes: torchrun --nproc_per_node=N -m vitlab train (or "
        "finetune)"], stderr[-3000:]
    assert not out.exists() and stdout == ""


def test_finetune_and_sweep(tmp_path, capsys):
    base = ["--recipe", "demo", "--data", "digits", "--batch-size", "16", "--val-split", "100", *TINY]
    assert main(["train", *base, "--steps", "3", "--out", str(tmp_path / "pre")]) == 0
    pre = last_json_line(capsys.readouterr().out)
    # fine-tune at twice the resolution: the 2x2 grid of position embeddings becomes 4x4
    ft_args = ["finetune", "--init", pre["weights"], "--recipe", "demo", "--data", "digits", "--img-size", "32",
               "--steps", "3", "--batch-size", "16", "--val-split", "100", "--set", "optim.optimizer=sgd",
               "--set", "run.threads=1", "--set", "run.tensorboard=false", "--quiet", "--out", str(tmp_path / "ft")]
    assert main(ft_args) == 0
    ft = last_json_line(capsys.readouterr().out)
    model = load_model(ft["weights"])
    assert model.cfg.img_size == (32, 32) and model.cfg.num_classes == 10 and ft["steps"] == 3
    assert main(["sweep", *base, "--steps", "2", "--grid", "0.01,0.1", "--out", str(tmp_path / "sweep")]) == 0
    report = last_json_line(capsys.readouterr().out)
    assert set(report["holdout_top1"]) == {"0.01", "0.1"} and report["best_lr"] in (0.01, 0.1)
    assert load_model(report["final"]["weights"]).cfg.num_classes == 10


def test_a_non_square_run_trains_scores_and_fine_tunes_at_its_height_and_width(tmp_path, capsys, tiny_checkpoint):
    """train --img-size 16x24 was refused (--img-size N only); through model.overrides a non-square run stopped at
    its first step (the loop resized each batch to its height by its height), and the digits were square only."""
    base = ["--recipe", "demo", "--data", "digits", "--batch-size", "16", "--val-split", "100", *TINY]
    assert main(["train", *base, "--img-size", "16x24", "--steps", "3", "--out", str(tmp_path / "pre")]) == 0
    pre = last_json_line(capsys.readouterr().out)
    model = load_model(pre["weights"])
    assert (model.cfg.img_size, model.cfg.grid_size) == ((16, 24), (2, 3))
    assert json.loads((tmp_path / "pre" / "config.json").read_text())["model"]["img_size"] == [16, 24]
    # eval scores the run's held-out digits at its size: the run's own figure
    assert main(["eval", "--checkpoint", pre["weights"], "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 100 and report["top1"] == pytest.approx(pre["val_top1"])
    assert main(["fewshot", pre["weights"], "--shots", "1", "--seeds", "1", "--feature-cache", "none", "--json",
                 "--device", "cpu", "--img-size", "24x16"]) == 0
    assert json.loads(capsys.readouterr().out)["feature_dim"] == 16
    ft = ["finetune", "--recipe", "demo", "--data", "digits", "--steps", "2", "--batch-size", "16", "--val-split",
          "100", "--set", "run.threads=1", "--set", "run.tensorboard=false", "--quiet"]
    # from the non-square run to another non-square grid, and from a square init (2x2) to a non-square one
    for init, size, grid in ((pre["weights"], "24x16", (3, 2)), (tiny_checkpoint, "16x32", (2, 4))):
        out = tmp_path / f"ft-{size}"
        assert main([*ft, "--init", init, "--img-size", size, "--out", str(out)]) == 0
        tuned = load_model(last_json_line(capsys.readouterr().out)["weights"])
        assert (tuned.cfg.img_size, tuned.cfg.grid_size) == (tuple(map(int, size.split("x"))), grid)


def test_finetune_from_weights_of_another_model_than_the_recipe_names(tmp_path, capsys):
    """Not named (--model), a fine-tune's model.name is its recipe's (paper_finetune's ViT-B/16, the demo's
    ViT-Ti/16), which was held against the init as the model it must be: any vit_jax .npz, Hugging Face
    folder or timm file of another model was refused ('the weights are not a ViT-Ti/16'), in the memory
    estimate of --show-config and at the start of the run."""
    import vitlab

    model = vitlab.create_model(vitlab.get_config("ViT-Ti/16", img_size=16, patch_size=8, width=16, depth=1,
                                                  num_heads=2, mlp_dim=32, num_classes=10))
    vitlab.save_official_npz(model, tmp_path / "w.npz")
    ft = ["finetune", "--init", str(tmp_path / "w.npz"), "--recipe", "demo", "--data", "digits", "--img-size", "32",
          "--steps", "1", "--batch-size", "16", "--val-split", "100", "--set", "run.threads=1",
          "--set", "run.tensorboard=false", "--quiet", "--out", str(tmp_path / "ft")]
    assert main([*ft, "--show-config"]) == 0
    assert "not_estimated" not in json.loads(capsys.readouterr().out)["memory_estimate"]
    assert main(ft) == 0
    tuned = load_model(last_json_line(capsys.readouterr().out)["weights"])
    assert (tuned.cfg.width, tuned.cfg.num_heads, tuned.cfg.img_size) == (16, 2, (32, 32))


def test_show_config_takes_section_names_old_flat_names_and_the_fast_flags(capsys):
    assert main(["train", "--recipe", "demo", "--show-config", "--set", "lr=0.5", "--set", "run.threads=2",
                 "--set", "model.width=32"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert set(cfg) == {"recipe", "model", "data", "augment", "optim", "run", "resolved", "memory_estimate"}
    assert cfg["optim"]["lr"] == 0.5 and cfg["run"]["threads"] == 2 and cfg["model"]["overrides"]["width"] == 32
    assert cfg["run"]["fast"] is True and cfg["run"]["retain_freed_memory"] is False  # the defaults
    assert main(["train", "--recipe", "demo", "--show-config", "--no-fast", "--retain-freed-memory"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["run"]["fast"] is False and cfg["run"]["retain_freed_memory"] is True


def test_no_fast_trains_the_plain_model_into_the_same_weights_file(tmp_path, capsys, monkeypatch):
    from safetensors import safe_open

    from vitlab import fast

    optimized = []
    original = fast.optimize
    monkeypatch.setattr(fast, "optimize", lambda model, *a, **kw: optimized.append(1) or original(model, *a, **kw))
    base = ["train", "--recipe", "demo", "--data", "digits", "--batch-size", "16", "--val-split", "100", "--steps",
            "2", *TINY]
    keys = []
    for flags, name in (([], "fast"), (["--no-fast"], "plain")):
        assert main(base + flags + ["--out", str(tmp_path / name)]) == 0
        with safe_open(last_json_line(capsys.readouterr().out)["weights"], "pt") as f:
            keys.append(sorted(f.keys()))
    assert optimized == [1]  # the default run only
    assert keys[0] == keys[1] and keys[0]


def test_calibrate_prints_the_chosen_kernels_the_auto_precision_and_the_file(tmp_path, capsys, monkeypatch):
    from vitlab.fast import KernelChoice, calibration, kernels

    path = tmp_path / "kernels.json"
    seconds = {"fp32": {"training": {"plain": 1.0, "onednn/fused": 0.5}}}
    calls = []

    def fake_calibrate(path=None, rounds=3, say=lambda line: None):
        calls.append(rounds)
        say("fp32 training (ViT-CIFAR b128): plain 1000 ms, onednn/fused 500 ms")
        return KernelChoice(fp32="onednn", bf16="widened", inference=("bf16",)), "fp32", seconds

    monkeypatch.setattr(calibration, "calibrate", fake_calibrate)
    monkeypatch.setattr(kernels, "calibration_path", lambda: path)
    threads = torch.get_num_threads()
    assert main(["calibrate", "--rounds", "2", "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads  # the caller's thread count is given back
    out = capsys.readouterr().out
    assert calls == [2]
    assert "plain 1000 ms" in out and str(path) in out
    assert "chosen: fp32 onednn, bf16 widened, attention fused, plain in fp32 inference" in out
    assert "--precision auto means fp32" in out
    assert main(["calibrate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kernels"]["fp32"] == "onednn" and report["kernels"]["inference"] == ["bf16"]
    assert report["precision"] == "fp32" and report["seconds_per_step"] == seconds and report["path"] == str(path)
    assert main(["calibrate", "--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "vitlab calibrate: error: --rounds=0: must be >= 1"
    from vitlab.machine import usable_cores

    cores = usable_cores()
    for threads in (-1, cores + 1):  # far above the cores, OpenMP's thread pool crashed the process
        assert main(["calibrate", "--threads", str(threads)]) == 2
        assert capsys.readouterr().err.strip() == (f"vitlab calibrate: error: --threads={threads}: this process may "
                                                   f"use {cores} core(s) here; give 1 to {cores}, or 0 for PyTorch's "
                                                   "default (at most those)")
    assert calls == [2, 3]  # neither refusal timed anything


def test_an_interrupted_run_says_what_its_resume_goes_on_from(tmp_path, capsys, monkeypatch):
    """Ctrl-C said "run it again with --resume to go on from where it stopped" of a run that had written no
    checkpoint (the demo's run.ckpt_every=0), whose --resume trained it again from step 0."""
    from vitlab.train import loop

    real_step, calls = loop.train_step, []

    def interrupted_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", interrupted_at_step_3)
    command = ["train", "--recipe", "demo", "--data", "digits", "--steps", "4", "--out", str(tmp_path / "run"),
               "--quiet", "--set", "run.threads=1", "--set", "run.tensorboard=false"]
    assert main(command) == 130
    assert capsys.readouterr().err == ("vitlab train: interrupted; no checkpoint of it was written (run.ckpt_every=0: "
                                       "the last step alone), so --resume would train it again from step 0\n")
    calls.clear()
    assert main([*command, "--set", "run.ckpt_every=2", "--resume"]) == 130
    assert capsys.readouterr().err == ("vitlab train: interrupted; run it again with --resume to go on from its newest "
                                       f"checkpoint, {tmp_path / 'run' / 'checkpoints' / 'ckpt-00000002.pt'}\n")


def test_show_config_under_torchrun_is_printed_by_rank_0_alone(tiny_checkpoint, capsys, monkeypatch):
    # every process of the launch printed the whole config: as many copies, interleaved, as processes
    monkeypatch.setenv("WORLD_SIZE", "2")
    for command in (["train", "--recipe", "demo", "--data", "digits"], ["finetune", "--init", tiny_checkpoint]):
        monkeypatch.setenv("RANK", "1")
        assert main([*command, "--show-config"]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out == ""
        monkeypatch.setenv("RANK", "0")
        assert main([*command, "--show-config"]) == 0, capsys.readouterr().err
        assert "recipe" in json.loads(capsys.readouterr().out)
    monkeypatch.setenv("RANK", "1")  # every process checks it: a refusal is each one's
    assert main(["train", "--recipe", "demo", "--data", "digits", "--set", "optim.lr=-1", "--show-config"]) == 2
    assert "optim.lr=-1" in capsys.readouterr().err


def test_show_config_needs_no_data(tiny_checkpoint, capsys):
    for command in (["train", "--recipe", "paper_pretrain"], ["finetune", "--init", tiny_checkpoint],
                    ["sweep", "--recipe", "paper_finetune"]):
        assert main([*command, "--show-config"]) == 0, capsys.readouterr().err
        shown = json.loads(capsys.readouterr().out)
        assert "recipe" in shown or "final" in shown


def test_show_config_refuses_an_init_here_that_is_no_weights(tmp_path, capsys):
    """An init that is a file but no weights (text named x.safetensors) is refused in one line by the run;
    --show-config printed its config all the same, the estimate alone 'not_estimated', and exited 0."""
    init = tmp_path / "x.safetensors"
    init.write_text("not weights\n")
    for name, model in (("finetune", []), ("finetune", ["--model", "ViT-Ti/16"]), ("sweep", ["--grid", "0.01"])):
        command = [name, "--init", str(init), "--recipe", "demo", "--data", "digits", *model, "--show-config"]
        assert main(command) == 2, command
        out, err = capsys.readouterr()
        (line,) = err.splitlines()
        assert out == "" and line.startswith(f"vitlab {name}: error: ") and \
            f"{init} is not a readable safetensors file" in line, command


def test_show_config_refuses_an_init_that_is_not_here_as_the_run_does(tmp_path, capsys):
    """A local init that is not there (a mistyped path) is refused by the run in one line; --show-config
    printed its config, the estimate alone 'not_estimated', and exited 0.  A Hub name is read as the run
    starts, and still shown."""
    missing = str(tmp_path / "no" / "x.safetensors")
    for command in (["finetune", "--init", missing], ["train", "--set", f"model.init={missing}"],
                    ["sweep", "--init", missing, "--grid", "0.01"]):
        assert main([*command, "--recipe", "demo", "--data", "digits", "--show-config"]) == 2, command
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            f"vitlab {command[0]}: error: model.init={missing!r}: no such file or folder"], command
        assert main([*command, "--recipe", "demo", "--data", "digits", "--steps", "1",
                     "--out", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err.splitlines() == err.splitlines()  # the run's line


@pytest.mark.parametrize("dataset, share", [("pets", 0.1), ("flowers", 0.1), ("cifar10", 0.02), ("cifar100", 0.02),
                                            ("imagenet", 0.01)])
def test_sweep_holds_out_the_papers_share_per_dataset(dataset, share, capsys, tiny_checkpoint):
    """Appendix B.1.1: 10% of the training set for Pets and Flowers, 2% for CIFAR, 1% for ImageNet."""
    recipe = ["sweep", "--recipe", f"paper_finetune:dataset={dataset}", "--init", tiny_checkpoint]
    assert main([*recipe, "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["holdout"] == share
    assert main([*recipe, "--holdout", "0.25", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["holdout"] == 0.25
    assert main([*recipe, "--holdout", "500", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["holdout"] == 500


def test_sweep_holds_out_the_split_set_on_its_recipe(capsys, tiny_checkpoint):
    """--set data.val_split changes the recipe's split the grid is compared on (--holdout still wins, and
    --val-split is the final run's): it was accepted, and the grid was compared on the recipe's 10%."""
    recipe = ["sweep", "--recipe", "paper_finetune:dataset=pets", "--init", tiny_checkpoint, "--show-config"]
    for extra, holdout, final in ((["--set", "data.val_split=0.2"], 0.2, 0), (["--set", "val_split=300"], 300, 0),
                                  (["--set", "data.val_split=0.2", "--holdout", "0.05"], 0.05, 0),
                                  (["--set", "data.val_split=0.2", "--val-split", "0.3"], 0.2, 0.3)):
        assert main([*recipe, *extra]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["holdout"], shown["final"]["data"]["val_split"]) == (holdout, final), extra


def test_fp8_is_a_flag_whose_refusal_on_this_cpu_is_one_line(capsys):
    assert main(["train", "--recipe", "demo", "--show-config", "--precision", "bf16", "--fp8", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["fp8"] == "off"
    for asked, field in ((["--precision", "bf16", "--fp8", "rowwise"], "needs a CUDA GPU of compute capability 8.9"),
                         (["--precision", "fp32", "--fp8", "tensorwise"], "set run.precision to 'bf16' or 'auto'")):
        assert main(["train", "--recipe", "demo", "--show-config", "--set", "run.device=cpu", *asked]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vitlab train: error: run.fp8=") and field in err and len(err.strip().splitlines()) == 1
