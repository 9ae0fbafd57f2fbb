"""`paper_pretrain` end to end on a tiny synthetic ImageNet-21k-style set, packed into shards.

The same commands run on the real data (only --data, and the tiny-model flags dropped).
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlab.cli import main
from vitlab.config import ConfigError

WNIDS = ["n00004475", "n00005787", "n00006024", "n01440764"]  # ImageNet-21k's class folders are WordNet ids
TINY = ["--model", "ViT-Ti/16", "--img-size", "16", "--set", "model.patch_size=8", "--set", "model.width=16",
        "--set", "model.depth=1", "--set", "model.num_heads=2", "--set", "model.mlp_dim=32", "--set", "run.threads=1",
        "--set", "run.tensorboard=false", "--set", "run.precision=fp32", "--quiet"]


def imagenet21k_like(root: Path, per_class=8) -> Path:
    rng = np.random.default_rng(0)
    for c, wnid in enumerate(WNIDS):
        (root / wnid).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / wnid / f"{wnid}_{i}.JPEG")
    return root


def test_paper_pretrain_end_to_end_on_shards(tmp_path, capsys):
    assert main(["pack-shards", str(imagenet21k_like(tmp_path / "i21k")), str(tmp_path / "shards"),
                 "--per-shard", "4"]) == 0
    out = tmp_path / "run"
    code = main(["train", "--recipe", "paper_pretrain:dataset=i21k", "--data", str(tmp_path / "shards"),
                 "--val-split", "0", "--batch-size", "16", "--accum-steps", "2", "--steps", "3", "--out", str(out),
                 "--set", "optim.warmup=1", "--set", "run.log_every=1", "--set", "data.stream_workers=2", *TINY])
    assert code == 0
    summary = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 3 and summary["train_examples"] == 32
    assert json.loads((out / "classes.json").read_text()) == WNIDS  # the label map: class id -> WordNet id
    config = json.loads((out / "config.json").read_text())
    assert config["optim"]["loss"] == "sigmoid_xent" and config["optim"]["batch_size"] == 16
    assert config["model"]["head_bias_init"] is None  # the default: -ln K from scratch
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # the head's weights start at zero and its bias at -ln 4, as big_vision starts sigmoid pre-training: each class at
    # p = 1/5, the label's loss ln 5 and each of the 3 others' ln(5/4) (a zero bias started every class at p = 1/2,
    # 4 ln 2, a loss growing with the classes: 15,140 on ImageNet-21k's 21,843)
    assert first["step"] == 1 and math.isclose(first["loss"], math.log(5) + 3 * math.log(5 / 4), rel_tol=1e-3)


def test_paper_batch_4096_must_divide(capsys):
    # 4096 over 3 micro-batches does not divide: refused before any data is read
    code = main(["train", "--recipe", "paper_pretrain", "--data", "/nonexistent/{0000..0009}.tar",
                 "--accum-steps", "3"])
    assert code == 2 and "optim.batch_size=4096" in capsys.readouterr().err


# The paper's Table 3, as printed: (model, dataset, base lr, the epochs it lists).  All rows: Adam,
# batch 4096, 10k warm-up; JFT-300M weight decay 0.1, dropout 0.0, linear decay; ImageNet-21k 0.03,
# 0.1, linear; ImageNet ("ViT-*") 300 epochs, 3e-3, cosine, 0.3, 0.1.
TABLE_3 = [
    ("ViT-B/16", "jft", 8e-4, (7,)), ("ViT-B/32", "jft", 8e-4, (7,)), ("ViT-L/32", "jft", 6e-4, (7,)),
    ("ViT-L/16", "jft", 4e-4, (7, 14)), ("ViT-H/14", "jft", 3e-4, (14,)),
    ("R50x1", "jft", 1e-3, (7,)), ("R50x2", "jft", 1e-3, (7,)), ("R101x1", "jft", 8e-4, (7,)),
    ("R152x1", "jft", 6e-4, (7,)), ("R152x2", "jft", 6e-4, (7,)),
    ("R50+ViT-B/16", "jft", 8e-4, (7,)), ("R50+ViT-B/32", "jft", 8e-4, (7,)), ("R50+ViT-L/32", "jft", 2e-4, (7,)),
    ("R50+ViT-L/16", "jft", 4e-4, (7, 14)),
    ("ViT-B/16", "i21k", 1e-3, (90,)), ("ViT-B/32", "i21k", 1e-3, (90,)),
    ("ViT-L/16", "i21k", 1e-3, (30, 90)), ("ViT-L/32", "i21k", 1e-3, (30, 90)),
]
IMAGES = {"jft": 303e6, "i21k": 14_197_122}  # Sec. 4.1: JFT-300M's 303M images; ImageNet-21k's 14.2M
ROW = {"jft": (0.1, 0.0), "i21k": (0.03, 0.1)}  # weight decay, dropout


@pytest.mark.parametrize("model, dataset, lr, epochs", TABLE_3, ids=[f"{m}-{d}" for m, d, _, _ in TABLE_3])
def test_every_model_of_table_3_gets_its_own_rate_and_epochs(model, dataset, lr, epochs):
    from vitlab.configs import load_recipe
    from vitlab.models.registry import canonical_name

    for n, count in enumerate(epochs):
        spec = f"paper_pretrain:dataset={dataset}" + (f",epochs={count}" if n else "")  # the first is the default
        cfg = load_recipe(spec, model_name=model)
        o = cfg.optim
        assert cfg.model.name == canonical_name(model)
        assert o.lr == lr and (o.weight_decay, o.decay, o.batch_size, o.warmup) == (ROW[dataset][0], "linear", 4096,
                                                                                    10_000)
        assert o.steps == pytest.approx(count * IMAGES[dataset] / 4096, rel=0.01), count
        if "ViT" in model:  # a ResNet has no dropout
            assert cfg.model.overrides["dropout"] == ROW[dataset][1] and cfg.model.pre_logits
        assert "[" not in cfg.recipe  # a row of the table: no note of a stand-in
    with pytest.raises(ConfigError, match="epochs"):
        load_recipe(f"paper_pretrain:dataset={dataset},epochs={sum(epochs) + 1}", model_name=model)


@pytest.mark.parametrize("model", ["ViT-B/16", "ViT-B/32", "ViT-L/16", "ViT-L/32", "ViT-H/14"])
def test_the_imagenet_row_is_every_vits(model):
    from vitlab.configs import load_recipe

    cfg = load_recipe("paper_pretrain_imagenet", model_name=model)
    o = cfg.optim
    assert cfg.model.name == model and (o.lr, o.decay, o.weight_decay, cfg.model.overrides["dropout"]) == (
        3e-3, "cosine", 0.3, 0.1)
    assert o.steps == pytest.approx(300 * 1_281_167 / 4096, rel=0.01) and "[" not in cfg.recipe


def test_a_model_table_3_has_no_row_for_says_whose_rate_it_takes():
    from vitlab.configs import load_recipe

    small = load_recipe("paper_pretrain", model_name="ViT-S/16")
    assert small.optim.lr == 8e-4 and "no ViT-S/16 row for JFT-300M: ViT-B/16's" in small.recipe
    huge = load_recipe("paper_pretrain:dataset=i21k", model_name="ViT-H/14")
    assert huge.optim.lr == 1e-3 and "no ViT-H/14 row for ImageNet-21k" in huge.recipe
    bit = load_recipe("paper_pretrain_imagenet", model_name="BiT-R50x1")
    assert bit.optim.lr == 3e-3 and "ImageNet row is the ViTs'" in bit.recipe and not bit.model.pre_logits


def test_show_config_shows_the_models_rate(capsys):
    assert main(["train", "--recipe", "paper_pretrain", "--model", "ViT-L/16", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["optim"]["lr"] == 4e-4
    assert main(["train", "--recipe", "paper_pretrain", "--set", "model.name=BiT-R101x1", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["optim"]["lr"] == 8e-4
    assert main(["train", "--recipe", "paper_pretrain:epochs=14", "--model", "ViT-H/14", "--lr", "1e-4",
                 "--show-config"]) == 0
    shown = json.loads(capsys.readouterr().out)["optim"]  # a flag given wins over the table
    assert shown["lr"] == 1e-4 and shown["steps"] == pytest.approx(14 * IMAGES["jft"] / 4096, rel=0.01)
