"""`paper_pretrain` end to end on a tiny synthetic ImageNet-21k-style set, packed into shards.

The same commands run on the real data (only --data, and the tiny-model flags dropped).
"""
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from vitlab.cli import main

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
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # the head starts at zero: every class's sigmoid cross-entropy is ln 2, summed over the 4 classes
    # (a softmax cross-entropy would start at ln 4 = half of that)
    assert first["step"] == 1 and math.isclose(first["loss"], 4 * math.log(2), rel_tol=1e-3)


def test_paper_batch_4096_must_divide(capsys):
    # 4096 over 3 micro-batches does not divide: refused before any data is read
    code = main(["train", "--recipe", "paper_pretrain", "--data", "/nonexistent/{0000..0009}.tar",
                 "--accum-steps", "3"])
    assert code == 2 and "optim.batch_size=4096" in capsys.readouterr().err
