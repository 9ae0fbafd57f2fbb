"""A fine-tune's init that records no image size, read at ``model.weights_img_size`` (--weights-img-size of
finetune, train, sweep and vtab, the flag every command that reads weights takes): a 2x8 grid of 16
patches (``helpers.sized_weights``) was read as 4x4, and fine-tuned at its own 8x32 resampled from
4x4 to 2x8, without a word, since no training command could say its size."""
import json

import pytest
import torch

from helpers.sized_weights import FLAG, SIZE, write_sized_weights
from vitlab.cli import build_parser, main
from vitlab.config import ConfigError
from vitlab.configs import load_recipe
from vitlab.train.overrides import with_changes
from vitlab.weights import WeightsError, load_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_sized_weights(tmp_path_factory.mktemp("sized"))


def fine_tune_of(saved, size=SIZE):
    return with_changes(load_recipe("demo"), {"model.init": str(saved / "w.npz"), "model.weights_img_size": size,
                                              "model.overrides": {}})  # as a run states it: the init's model


def test_the_init_is_read_at_weights_img_size(saved):
    from vitlab.train.build import make_model
    from vitlab.train.resolve import training_size

    cfg = fine_tune_of(saved)
    assert training_size(cfg) == SIZE  # the init's own size: its grid as trained, not a 4x4 one
    model = make_model(cfg, 10, SIZE)
    reference = load_model(saved / "ref.safetensors")
    torch.testing.assert_close(model.pos_embed.weight, reference.pos_embed.weight, rtol=0, atol=0)
    unsized = with_changes(cfg, {"model.weights_img_size": None})
    assert training_size(unsized) == (16, 16)  # nothing in the file tells: a square grid
    with pytest.raises(WeightsError, match=r"a 4x4 grid, or the 2x8 grid of img_size=\(8, 32\).*--weights-img-size"):
        make_model(unsized, 10, SIZE)


def test_weights_img_size_needs_an_init_and_is_kept_by_resume(saved):
    from vitlab.train.config import to_dict
    from vitlab.train.state import check_same_run

    with pytest.raises(ConfigError, match=r"^model.weights_img_size=\(8, 32\): the resolution model.init's weights "
                                          r"were trained at, and this model is trained from scratch"):
        with_changes(load_recipe("demo"), {"model.weights_img_size": SIZE})
    with pytest.raises(ConfigError, match=r"^model.weights_img_size='8x'"):
        fine_tune_of(saved, "8x")
    cfg = fine_tune_of(saved)
    with pytest.raises(ConfigError, match=r"model.weights_img_size=\(8, 32\) \(checkpoint: None\)"):
        check_same_run(cfg, to_dict(with_changes(cfg, {"model.weights_img_size": None})))
    check_same_run(cfg, json.loads(json.dumps(to_dict(cfg))))  # as config.json keeps it: a list


def last_json_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_finetune_trains_its_init_at_weights_img_size(saved, tmp_path, capsys):
    ft = ["finetune", "--init", str(saved / "w.npz"), "--recipe", "demo", "--data", "digits", "--steps", "1",
          "--batch-size", "16", "--val-split", "100", "--set", "run.threads=1", "--set", "run.tensorboard=false",
          "--quiet"]
    assert main([*ft, "--img-size", FLAG, "--out", str(tmp_path / "asked")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitlab finetune: error: ") and "--weights-img-size HxW" in err and err.count("\n") == 1
    assert main([*ft, "--weights-img-size", FLAG, "--out", str(tmp_path / "told")]) == 0
    tuned = load_model(last_json_line(capsys.readouterr().out)["weights"])
    assert tuned.cfg.img_size == SIZE
    assert json.loads((tmp_path / "told" / "config.json").read_text())["model"]["weights_img_size"] == [8, 32]


def test_train_sweep_and_vtab_take_the_flag_as_the_init_s_size(saved, tmp_path, capsys):
    init = str(saved / "w.npz")
    assert main(["train", "--recipe", "demo", "--set", f"model.init={init}", "--weights-img-size", FLAG,
                 "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["weights_img_size"] == [8, 32]
    assert main(["train", "--recipe", "demo", "--weights-img-size", FLAG, "--show-config"]) == 2
    assert "model.weights_img_size=(8, 32): the resolution model.init's weights were trained at" in \
        capsys.readouterr().err
    assert main(["sweep", "--recipe", "demo", "--init", init, "--grid", "0.01", "--weights-img-size", FLAG,
                 "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["final"]["model"]["weights_img_size"] == [8, 32]
    from vitlab.cli.vtab import base_config

    args = build_parser().parse_args(["vtab", "--init", init, "--tasks", str(tmp_path), "--weights-img-size", FLAG])
    assert base_config(args).model.weights_img_size == SIZE
