"""Recipes fit the model family: a BiT ResNet trains through every ViT recipe the paper
trains it with (Table 2 and 3's baselines, Table 7's optimisers); a ViT-only field is left
out for it, and refused only when set explicitly."""
import json

import pytest

from vitlab.cli import main
from vitlab.config import ConfigError, ResNetConfig
from vitlab.configs import list_recipes, load_recipe
from vitlab.train.build import architecture
from vitlab.train.overrides import VIT_ONLY_FIELDS, apply_overrides, with_changes

# every recipe a ResNet trains with; mpp's masked patch prediction is a ViT's by nature
BIT_RECIPES = ["paper_pretrain", "paper_pretrain:dataset=i21k", "paper_pretrain_imagenet", "paper_finetune",
               "vtab1k", "demo", "cifar10_scratch", "cifar10_scratch:model=hybrid_bit", "cifar10_scratch:model=vit"]


def test_every_recipe_but_mpp_is_listed():
    assert {r.split(":")[0] for r in BIT_RECIPES} == set(list_recipes()) - {"mpp"}


@pytest.mark.parametrize("recipe", BIT_RECIPES)
def test_a_bit_resnet_takes_every_recipe(recipe):
    vit = load_recipe(recipe)
    cfg = with_changes(vit, {"model.name": "BiT-R50x1"})
    built = architecture(cfg, num_classes=10)
    assert isinstance(built, ResNetConfig) and built.num_classes == 10
    for (section, key), off in VIT_ONLY_FIELDS.items():
        assert getattr(getattr(cfg, section), key) == off
    # what applies to both families stays: resolution, optimiser, schedule, augmentation
    assert built.img_size == architecture(vit).img_size
    assert (cfg.optim, cfg.augment) == (vit.optim, vit.augment)


def test_a_vit_field_set_explicitly_for_a_resnet_is_refused():
    recipe = load_recipe("paper_pretrain:dataset=i21k")
    with pytest.raises(ConfigError, match="dropout"):
        apply_overrides(recipe, ["model.name=BiT-R50x1", "model.dropout=0.1"])
    with pytest.raises(ConfigError, match="model.pre_logits"):
        apply_overrides(recipe, ["model.name=BiT-R50x1", "model.pre_logits=true"])
    with pytest.raises(ConfigError, match="model.mpp"):
        with_changes(load_recipe("mpp"), {"model.name": "BiT-R50x1"})
    # a ResNet's own fields are settable; the recipe's resolution still applies
    cfg = apply_overrides(load_recipe("demo"), ["model.name=BiT-R50x1", "model.width_factor=2", "model.layers=1,1"])
    built = architecture(cfg, 10)
    assert (built.width_factor, built.layers, built.img_size) == (2, (1, 1), (16, 16))


def test_clearing_the_recipes_overrides():
    cfg = apply_overrides(load_recipe("paper_pretrain:dataset=i21k"), ["model.overrides={}"])
    assert cfg.model.overrides == {} and architecture(cfg).dropout == 0.0
    with pytest.raises(ConfigError, match="model.overrides"):
        apply_overrides(load_recipe("demo"), ["model.overrides=7"])


def test_a_vit_named_where_the_recipes_overrides_leave_it_nothing_is_refused():
    # the demo's overrides set its model's whole shape: --model ViT-B/16 trained ViT-demo/4 (width 64) and
    # recorded ViT-B/16
    for recipe, own in (("demo", "'ViT-demo/4', width 64, depth 4"), ("cifar10_scratch", "'ViT-CIFAR/4', width 192")):
        with pytest.raises(ConfigError, match=rf"^model.name='ViT-B/16': the recipe's model.overrides \(.*\) set every "
                                              rf"field it differs from 'ViT-Ti/16' in, so the run would train the "
                                              rf"recipe's model \({own}"):
            with_changes(load_recipe(recipe), {"model.name": "ViT-B/16"})
    with pytest.raises(ConfigError, match=r"^model.name='ViT-B/16'"):  # a field changed too: the name still nothing
        apply_overrides(load_recipe("demo"), ["model.name=ViT-B/16", "model.width=128"])
    # the name is the base of overrides given whole, and of a recipe's that leave it its shape
    assert architecture(apply_overrides(load_recipe("demo"), ["model.name=ViT-B/16", "model.overrides={}"])).width == 768
    assert architecture(with_changes(load_recipe("paper_pretrain"), {"model.name": "ViT-L/16"})).width == 1024
    # fields set by name with it are the caller's choice, not the recipe's shadowing (vtab1k has no overrides)
    tiny = ["model.name=ViT-Ti/16", "model.patch_size=8", "model.width=16", "model.depth=1", "model.num_heads=2",
            "model.mlp_dim=32"]
    assert apply_overrides(load_recipe("vtab1k"), tiny).model.name == "ViT-Ti/16"


def test_the_recipes_own_model_named_where_its_overrides_make_another_is_refused(capsys):
    """The demo's base model is ViT-Ti/16 and its overrides make it ViT-demo/4: --model ViT-Ti/16 returned before any
    check (the recipe's name) and trained ViT-demo/4, width 64, as --model ViT-B/16 had; cifar10_scratch likewise.
    Overrides that leave the named model (paper_pretrain's dropout) and a name given with its overrides pass."""
    for recipe, own in (("demo", "'ViT-demo/4', width 64, depth 4"), ("cifar10_scratch", "'ViT-CIFAR/4', width 192")):
        for name in ("ViT-Ti/16", "ViT-Ti_16"):
            with pytest.raises(ConfigError, match=rf"^model.name='{name}': the recipe's model.overrides \(.*\) make "
                                                  rf"another model of it, so the run would train the recipe's model "
                                                  rf"\({own}"):
                with_changes(load_recipe(recipe), {"model.name": name})
    with pytest.raises(ConfigError, match=r"^model.name='ViT-Ti/16'"):  # a field changed too: still the demo's model
        apply_overrides(load_recipe("demo"), ["model.name=ViT-Ti/16", "model.width=128"])
    assert main(["train", "--recipe", "demo", "--model", "ViT-Ti/16", "--show-config"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "not ViT-Ti/16; --set 'model.overrides={}' trains ViT-Ti/16 as registered; leave model.name out for the "
        "recipe's")
    assert architecture(apply_overrides(load_recipe("demo"), ["model.name=ViT-Ti/16", "model.overrides={}"])).width == 192
    assert architecture(with_changes(load_recipe("paper_pretrain"), {"model.name": "ViT-B/16"})).width == 768
    assert architecture(with_changes(load_recipe("demo"), {"optim.steps": 5})).name == "ViT-demo/4"  # not named


@pytest.mark.parametrize("recipe", ["paper_pretrain", "cifar10_scratch"])
def test_the_cli_shows_and_trains_a_bit_resnet_with_a_vit_recipe(recipe, tmp_path, capsys):
    args = ["train", "--recipe", recipe, "--model", "BiT-R50x1"]
    assert main([*args, "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["pre_logits"] is False
    tiny = ["--data", "digits", "--img-size", "16", "--steps", "2", "--batch-size", "16", "--val-split", "100",
            "--set", "model.layers=1", "--set", "model.width_factor=0.5", "--set", "run.compile=false",
            "--set", "run.precision=fp32", "--set", "run.eval_every=0", "--set", "run.threads=1",
            "--set", "run.tensorboard=false", "--set", "run.time_limit=0", "--set", "run.final_eval_shift=0",
            "--quiet", "--out", str(tmp_path / "run")]
    if recipe == "cifar10_scratch":  # its Muon orthogonalises a ViT's blocks, which a ResNet has not: refused
        tiny += ["--set", "optim.optimizer=adam"]
    assert main([*args, *tiny]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == "BiT-R50x1" and summary["steps"] == 2
