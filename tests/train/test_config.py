import pytest

from vitlab.config import ConfigError
from vitlab.train.config import TrainConfig, apply_overrides, list_recipes, load_recipe, validate


def check(cfg, field, **kw):
    with pytest.raises(ConfigError, match=field):
        validate(cfg, **kw)


def test_errors_name_the_field(tmp_path):
    ok = TrainConfig(data="digits", model="ViT-Ti/16", img_size=32, model_overrides={"patch_size": 8})
    validate(ok)
    with pytest.raises(ConfigError, match="lr_rate"):
        apply_overrides(ok, ["lr_rate=0.1"])
    with pytest.raises(ConfigError, match="model.wdith"):
        apply_overrides(ok, ["model.wdith=3"])
    check(apply_overrides(ok, ["decay=exponential"]), "decay")
    check(apply_overrides(ok, ["batch_size=100", "accum_steps=3"]), "batch_size=100")
    check(apply_overrides(ok, ["batch_size=64"]), "world_size=3", world_size=3)
    check(apply_overrides(ok, ["img_size=30"]), "img_size")
    check(apply_overrides(ok, [f"data={tmp_path}/missing"]), "data")
    check(apply_overrides(ok, ["data=None"]), "data")
    check(apply_overrides(ok, ["lr=-1"]), "lr")
    check(apply_overrides(ok, ["warmup=5000", "steps=100"]), "warmup")
    check(apply_overrides(ok, ["label_smoothing=1.5"]), "label_smoothing")
    check(apply_overrides(ok, ["model=ViT-Q/16"]), "ViT-Q/16")
    check(apply_overrides(ok, ["ema_decay=0.9", "fsdp=true"]), "fsdp")
    with pytest.raises(ConfigError, match="fsdp"):
        apply_overrides(ok, ["fsdp=maybe"])
    check(TrainConfig(data="digits", retain_freed_memory="no"), "retain_freed_memory='no'")


def test_overrides_parse_types():
    cfg = apply_overrides(TrainConfig(), ["lr=1", "betas=0.9,0.95", "crop=none", "img_size=48", "flip=false",
                                          "model.width=256", "init=none", "val_split=0.1"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.betas == (0.9, 0.95) and cfg.crop == "none" and cfg.img_size == 48 and cfg.flip is False
    assert cfg.model_overrides == {"width": 256} and cfg.init is None and cfg.val_split == 0.1


def test_every_recipe_loads_and_is_consistent():
    names = list_recipes()
    assert {"paper_pretrain", "paper_pretrain_imagenet", "paper_finetune", "vtab1k", "cifar10_scratch",
            "demo"} <= set(names)
    for name in names:
        validate(load_recipe(name), need_data=False)
    pre = load_recipe("paper_pretrain")
    assert (pre.batch_size, pre.weight_decay, pre.warmup, pre.decay, pre.clip_norm) == (4096, 0.1, 10_000, "linear", 1.0)
    assert pre.betas == (0.9, 0.999) and pre.pre_logits
    i21k = load_recipe("paper_pretrain:dataset=i21k")
    assert i21k.model_overrides["dropout"] == 0.1 and i21k.weight_decay == 0.03
    inet = load_recipe("paper_pretrain_imagenet")
    assert (inet.lr, inet.decay, inet.weight_decay, inet.model_overrides["dropout"]) == (3e-3, "cosine", 0.3, 0.1)
    for dataset, steps in (("cifar10", 10_000), ("cifar100", 10_000), ("imagenet", 20_000), ("pets", 500),
                           ("flowers", 500)):
        ft = load_recipe(f"paper_finetune:dataset={dataset}")
        assert (ft.steps, ft.optimizer, ft.momentum, ft.batch_size, ft.weight_decay, ft.decay) == (
            steps, "sgd", 0.9, 512, 0.0, "cosine")
    assert load_recipe("paper_finetune").lr_grid == (0.001, 0.003, 0.01, 0.03)
    vtab = load_recipe("vtab1k")
    assert (vtab.lr, vtab.steps, vtab.train_examples, vtab.val_split) == (0.01, 2500, 1000, 200)
    assert load_recipe("vtab1k:final=true").val_split == 0
    from vitlab.train.config import model_config

    for variant, tokens, norm in (("hybrid", 16, "batch"), ("hybrid_bit", 16, "group"), ("vit", 64, None)):
        cifar = load_recipe(f"cifar10_scratch:model={variant}")  # every CIFAR model builds, at 32 px
        validate(cifar, need_data=False)
        built = model_config(cifar, num_classes=10)
        assert built.num_patches == tokens
        assert (built.resnet.norm if built.resnet else None) == norm
    with pytest.raises(ConfigError, match="model='resnet'"):
        load_recipe("cifar10_scratch:model=resnet")
    with pytest.raises(ConfigError, match="no such recipe"):
        load_recipe("paper_pretrian")


def test_demo_recipe_is_small():
    demo = load_recipe("demo")
    assert demo.data == "digits" and demo.val_split > 0 and demo.out == "runs/demo"
    validate(demo)
