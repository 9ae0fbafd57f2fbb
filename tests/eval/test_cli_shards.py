"""`vitlab eval` and `vitlab fewshot` on tar shards: a folder of them, a brace pattern, a glob;
and a streamed run's own held-out shards."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.config import ViTConfig
from vitlab.data.shards import pack_shards
from vitlab.models import create_model

weights = pytest.importorskip("vitlab.weights")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(image folder, its shards, a run folder trained on those shards with 12 held out)."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / "folder" / f"c{c}").mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 80, (8, 8, 3), dtype=np.uint8)
            pixels[:, :, c] += 150
            Image.fromarray(pixels).save(root / "folder" / f"c{c}" / f"{i}.png")
    pack_shards(root / "folder", root / "shards", samples_per_shard=6)
    torch.manual_seed(0)
    model = create_model(ViTConfig(img_size=8, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2,
                                   num_classes=3, name="ViT-tiny"))
    with torch.no_grad():
        model.head.weight.normal_(0, 0.3)
    run = root / "run"
    run.mkdir()
    weights.save_model(model, run / "model.safetensors")
    (run / "config.json").write_text(json.dumps({"recipe": "test", "data": {
        "source": str(root / "shards"), "stream": "stream", "val_split": 12, "split_seed": 0}}))
    (run / "classes.json").write_text(json.dumps(["c0", "c1", "c2"]))
    return root / "folder", root / "shards", run


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_reads_shards_patterns_and_globs(data, tmp_path, capsys):
    folder, shards, run = data
    cache = tmp_path / "cache"
    results = []
    for source in (folder, shards, shards / "shard-{000000..000004}.tar", shards / "shard-*.tar"):
        assert main(["eval", "--checkpoint", str(run / "model.safetensors"), "--data", str(source),
                     "--val-split", "0", "--json", "--cache-dir", str(cache)]) == 0
        out = last_json(capsys)
        results.append((out["n"], out["top1"], out["confusion_matrix"]))
    assert results[0][0] == 30 and all(r == results[0] for r in results)  # the same 30 images, however named


def test_eval_of_a_streamed_run_scores_its_held_out_shards(data, tmp_path, capsys):
    from vitlab.data.stream import hold_out, open_source

    _, shards, run = data
    assert main(["eval", "--checkpoint", str(run / "model.safetensors"), "--json",
                 "--cache-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["n"] == hold_out(open_source(str(shards)), 12, 0)[1].num_samples == 12
    assert "the run's held-out shards" in captured.err


def test_fewshot_of_a_streamed_run_scores_its_held_out_shards_with_its_training_shards_as_the_pool(data, tmp_path,
                                                                                                   capsys):
    """fewshot of a streamed run split the whole set, stratified, where the run held out whole shards: its
    evaluation part held images of the run's training shards, the model's own training images, scored as
    held out (with as many of them as the run held out: nothing told)."""
    from vitlab.data.labelled import load_held_out
    from vitlab.data.memory import load_source_in_memory
    from vitlab.data.stream import hold_out, open_source

    _, shards, run = data
    scored = load_held_out(json.loads((run / "config.json").read_text())["data"], 8, cache_dir=tmp_path)
    training, held = (load_source_in_memory(part, 8, tmp_path) for part in hold_out(open_source(str(shards)), 12, 0))
    assert torch.equal(scored.images[scored.held], held.images)
    assert torch.equal(scored.images[scored.rest], training.images)
    assert main(["fewshot", str(run / "model.safetensors"), "--shots", "1", "--seeds", "1", "--holdout-per-class",
                 "2", "--feature-cache", "none", "--cache-dir", str(tmp_path)]) == 0
    assert "pool 18, evaluation 12 (the run's held-out shards, val_split 12, seed 0)" in capsys.readouterr().err


def test_fewshot_reads_a_brace_pattern(data, tmp_path, capsys):
    _, shards, run = data
    assert main(["fewshot", str(run / "model.safetensors"), "--data", str(shards / "shard-{000000..000004}.tar"),
                 "--val-split", "9", "--shots", "1", "2", "--seeds", "2", "--holdout-per-class", "2",
                 "--feature-cache", "none", "--cache-dir", str(tmp_path), "--json"]) == 0
    out = last_json(capsys)["fewshot"]
    assert set(out) == {"1", "2"} and all(0.0 <= v["mean"] <= 1.0 for v in out.values())
    assert main(["eval", "--checkpoint", str(run / "model.safetensors"), "--data", str(shards / "nothing-*.tar")]) == 2
    assert "the pattern matches no file" in capsys.readouterr().err


def test_eval_and_fewshot_name_and_count_a_cut_shard(data, tmp_path, capsys, caplog):
    import shutil

    from vitlab.data.shards import read_shard

    _, shards, run = data
    bad = tmp_path / "shards_bad"
    shutil.copytree(shards, bad)
    cut = bad / "shard-000001.tar"
    cut.write_bytes(cut.read_bytes()[:3000])
    lost = 6 - sum(1 for _ in read_shard(cut, []))
    assert lost > 0
    ckpt = str(run / "model.safetensors")
    assert main(["eval", "--checkpoint", ckpt, "--data", str(bad), "--val-split", "0", "--json",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["n"] == 30 - lost and out["skipped_images"] == lost
    assert f"{cut}: {lost} of its 6 images could not be read" in caplog.text  # a warning
    assert f"{30 - lost} images, all examples; {lost} unreadable image(s) left out" in captured.err
    caplog.clear()
    assert main(["fewshot", ckpt, "--data", str(bad), "--val-split", "9", "--shots", "1", "--seeds", "1",
                 "--holdout-per-class", "2", "--feature-cache", "none", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert f"{cut}: {lost} of its 6 images could not be read" in caplog.text  # from the cache: named all the same
    assert f"{lost} unreadable image(s) left out" in capsys.readouterr().err


def test_fewshot_of_a_multi_label_set_is_refused_not_probed_by_each_images_first_label(data, tmp_path, capsys):
    """JFT-style shards of several labels an image were probed by each image's first label: drawn, fitted and
    scored as if the others were not there, and the table printed as any set's."""
    from helpers.multi_label import multi_label_shard

    _, _, run = data
    shards = multi_label_shard(tmp_path / "jft", ["0,2", "1", "2,1,0", "2", "1"] * 6, per_shard=10)
    assert main(["fewshot", str(run / "model.safetensors"), "--data", str(shards), "--val-split", "6", "--shots", "1",
                 "--seeds", "1", "--holdout-per-class", "1", "--feature-cache", "none",
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitlab fewshot: error: the training pool: labels of shape (24, 3), a "
                                                "multi-label set's")
    assert "the few-shot probe is single-label" in err[0]
