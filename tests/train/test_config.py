import dataclasses
import json
import re
from pathlib import Path

import pytest

from vitlab.analysis.cost import model_flops
from vitlab.config import ConfigError
from vitlab.configs import list_recipes, load_recipe
from vitlab.data.transforms import Augmentation, TrainTransform
from vitlab.train.build import architecture, check_can_run
from vitlab.train.config import (SECTIONS, AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig,
                                 from_dict, to_dict)
from vitlab.train.legacy import LEGACY_NAMES
from vitlab.train.overrides import apply_overrides, field_names, parse_overrides, with_changes
from vitlab.train.resolve import training_size
from vitlab.train.schedules import warmup_steps

OK = TrainConfig(model=ModelConfig(name="ViT-Ti/16", img_size=32, overrides={"patch_size": 8}),
                 data=DataConfig(source="digits"))


def refused(field, build):
    with pytest.raises(ConfigError, match=field):
        build()


def test_errors_name_the_field(tmp_path):
    check_can_run(OK)
    with pytest.raises(ConfigError, match="lr_rate"):
        apply_overrides(OK, ["lr_rate=0.1"])
    with pytest.raises(ConfigError, match="model.wdith"):
        apply_overrides(OK, ["model.wdith=3"])
    with pytest.raises(ConfigError, match="optim.lr_rate"):
        apply_overrides(OK, ["optim.lr_rate=0.1"])
    refused("optim.decay='exponential'", lambda: apply_overrides(OK, ["optim.decay=exponential"]))
    refused("batch_size=100", lambda: apply_overrides(OK, ["optim.batch_size=100", "optim.accum_steps=3"]))
    with pytest.raises(ConfigError, match="world_size=3"):
        check_can_run(apply_overrides(OK, ["optim.batch_size=64"]), world_size=3)
    refused("img_size", lambda: apply_overrides(OK, ["model.img_size=30"]))
    with pytest.raises(ConfigError, match="data.source"):
        check_can_run(apply_overrides(OK, [f"data.source={tmp_path}/missing"]))
    with pytest.raises(ConfigError, match="data.source=None"):
        check_can_run(apply_overrides(OK, ["data.source=None"]))
    refused("optim.lr=-1", lambda: apply_overrides(OK, ["optim.lr=-1"]))
    refused("optim.warmup", lambda: apply_overrides(OK, ["optim.warmup=5000", "optim.steps=100"]))
    refused("augment.label_smoothing=1.5", lambda: apply_overrides(OK, ["augment.label_smoothing=1.5"]))
    refused("ViT-Q/16", lambda: apply_overrides(OK, ["model.name=ViT-Q/16"]))
    refused("fsdp", lambda: apply_overrides(OK, ["optim.ema_decay=0.9", "run.fsdp=true"]))
    with pytest.raises(ConfigError, match="fsdp"):
        apply_overrides(OK, ["run.fsdp=maybe"])


def test_sections_check_themselves_when_built():
    # no separate validate() to remember: an impossible value cannot be built at all
    refused("run.retain_freed_memory='no'", lambda: RunConfig(retain_freed_memory="no"))
    refused("optim.optimizer='lamb'", lambda: OptimConfig(optimizer="lamb"))
    refused("allowed values are 'adam', 'sgd'", lambda: OptimConfig(optimizer="lamb"))
    refused("optim.min_lr=0.1: must not exceed optim.lr=0.01", lambda: OptimConfig(lr=0.01, min_lr=0.1))
    # a constant lr never decays to it: the value was accepted and the lr stayed at optim.lr
    refused(r"optim.min_lr=0.0001: where the decay ends, and optim.decay='constant' keeps optim.lr to the last step",
            lambda: OptimConfig(decay="constant", min_lr=1e-4))
    assert OptimConfig(decay="constant", warmup=5).min_lr == 0.0
    refused("optim.batch_size=10 is not divisible by optim.accum_steps=3",
            lambda: OptimConfig(batch_size=10, accum_steps=3))
    refused("augment.crop='random'", lambda: AugmentConfig(crop="random"))
    refused("augment.crop_scale", lambda: AugmentConfig(crop_scale=(0.5, 2.0)))
    refused("augment.erase_prob=2", lambda: AugmentConfig(erase_prob=2))
    refused("data.val_split=1.5", lambda: DataConfig(val_split=1.5))
    refused(r"data.progressive_sizes=\(24, 0.5\)", lambda: DataConfig(progressive_sizes=(24, 0.5)))
    refused("model.overrides", lambda: ModelConfig(overrides=[("width", 3)]))
    refused("model.name='ViT-Q/16'", lambda: ModelConfig(name="ViT-Q/16"))
    # the model the overrides make is named, not only the registry entry they change
    refused(r"^model \('ViT-demo/4': model.name='ViT-Ti/16' with model.overrides, model.img_size\): img_size=\(30, 30\)",
            lambda: ModelConfig(name="ViT-Ti/16", overrides={"patch_size": 4, "name": "ViT-demo/4"}, img_size=30))
    refused("run.time_measure_steps=0", lambda: RunConfig(time_measure_steps=0))
    refused("run.precision='fp8'", lambda: RunConfig(precision="fp8"))
    refused("run.on_nonfinite='ignore': allowed values are 'stop', 'skip'", lambda: RunConfig(on_nonfinite="ignore"))
    refused("run.loss_scale=0", lambda: RunConfig(loss_scale=0))
    refused("run.max_skipped_steps=-1", lambda: RunConfig(max_skipped_steps=-1))
    refused(r"optim.lr_grid=\(0.1, 0.1, 0.3\): 0.1 given more than once", lambda: OptimConfig(lr_grid=(0.1, 0.1, 0.3)))
    # numpy's global seed takes 32 bits: beyond them the run failed at its start with an overflow naming no field
    refused(r"run.seed=4294967296: must be an integer in \[0, 2\*\*32 - 1", lambda: RunConfig(seed=2**32))
    assert RunConfig(seed=2**32 - 1).seed == 2**32 - 1
    refused("fp16.*fsdp", lambda: TrainConfig(run=RunConfig(precision="fp16", fsdp=True)))
    refused("fsdp", lambda: TrainConfig(optim=OptimConfig(ema_decay=0.9), run=RunConfig(fsdp=True)))
    refused("optim", lambda: TrainConfig(optim={"lr": 0.1}))
    refused("data.augment_batches=0: must be a positive integer", lambda: DataConfig(augment_batches=0))
    assert apply_overrides(OK, ["data.augment_batches=4"]).data.augment_batches == 4
    # mixup and CutMix mix each batch of a group within itself (tests/data/test_data_loader.py)
    assert apply_overrides(OK, ["data.augment_batches=4", "augment.cutmix_alpha=1.0"]).augment.cutmix_alpha == 1.0
    with pytest.raises(ConfigError, match="optim.lr"):  # replace builds the changed section anew
        with_changes(OK, {"optim.lr": 0.0})


def test_a_devices_settings_refuse_what_the_run_decides_before_them():
    # resolve reads the threads, precision and decoding processes before it applies run.on_device:
    # {"cpu": {"run.threads": 1}} was recorded in the config and the run used all its cores
    for changes in ({"run.threads": 1}, {"precision": "bf16"}, {"data.decode_workers": 1}, {"run.device": "cpu"}):
        name = next(iter(changes))
        with pytest.raises(ConfigError, match=rf"^run.on_device=.*: {name} for cpu: decided before a device's "):
            RunConfig(on_device={"cpu": changes})
    assert RunConfig(on_device={"cuda": {"optim.batch_size": 256, "run.compile": True}}).on_device


def test_a_setting_of_the_other_nonfinite_policy_is_refused():
    # run.max_skipped_steps bounds "skip" only: with "stop" a changed one was accepted and never read
    with pytest.raises(ConfigError, match=r"^run.max_skipped_steps=3: bounds the steps run.on_nonfinite='skip' leaves "
                                          r"out, and this run stops at the first \(run.on_nonfinite='stop'\); leave it "
                                          r"at 10"):
        RunConfig(max_skipped_steps=3)
    assert RunConfig(on_nonfinite="skip", max_skipped_steps=3).max_skipped_steps == 3
    assert RunConfig(on_nonfinite="stop").max_skipped_steps == 10
    for name in list_recipes():  # no recipe sets it without "skip"
        load_recipe(name)


def test_the_steps_timed_for_a_time_limit_are_refused_without_one():
    # run.time_measure_steps is read only to fit the schedule to run.time_limit: without one it did nothing
    with pytest.raises(ConfigError, match=r"^run.time_measure_steps=3: the steps timed to fit the schedule to "
                                          r"run.time_limit, and this run has no time limit \(0\); set run.time_limit, "
                                          r"or leave it at 10"):
        RunConfig(time_measure_steps=3)
    assert RunConfig(time_limit=5.0, time_measure_steps=3).time_measure_steps == 3
    assert with_changes(OK, {"run.time_measure_steps": 3, "run.time_limit": 1.0}).run.time_measure_steps == 3
    for name in list_recipes():  # no recipe sets it without a time limit
        load_recipe(name)


def test_the_loss_scale_and_the_fp8_settings_are_refused_where_the_run_does_not_read_them():
    # run.loss_scale is the fp16 gradient scaler's, run.fp8_layers and run.fp8_backend the fp8 matmuls': a bf16 run
    # given --set run.loss_scale=1024, or a run without --fp8 given the layers or torchao, trained as without them
    with pytest.raises(ConfigError, match=r"^run.loss_scale=1024: the first loss scale of an fp16 run's gradient "
                                          r"scaler, and run.precision='bf16' scales no loss; set run.precision to "
                                          r"'fp16', or leave it at 65536.0$"):
        RunConfig(precision="bf16", loss_scale=1024)
    assert RunConfig(precision="fp16", loss_scale=1024).loss_scale == 1024
    with pytest.raises(ConfigError, match=r"^run.fp8_layers=\('mlp.fc1',\): which dense layers of each block run.fp8 "
                                          r"puts in fp8, and this run has no fp8 matmuls \(run.fp8='off'\); set "
                                          r"run.fp8 \(--fp8\), or leave it at"):
        RunConfig(fp8_layers=("mlp.fc1",))
    with pytest.raises(ConfigError, match=r"^run.fp8_backend='torchao': whose arithmetic computes run.fp8's matmuls, "
                                          r"and this run has no fp8 matmuls"):
        with_changes(OK, {"run.fp8_backend": "torchao"})
    assert RunConfig(precision="bf16", fp8="rowwise", fp8_layers=("mlp.fc1",), fp8_backend="torchao").fp8_layers
    # a device's form of the run that turns fp8 on reads them
    assert RunConfig(precision="bf16", fp8_backend="torchao", on_device={"cuda": {"run.fp8": "rowwise"}}).fp8_backend
    for name in list_recipes():  # no recipe sets them where they are not read
        load_recipe(name)


def test_a_masked_patch_prediction_setting_is_refused_without_it():
    # model.mpp_rate is read by masked patch prediction only: on a classifier it was accepted and did nothing
    with pytest.raises(ConfigError, match=r"^model.mpp_rate=0.25: the fraction of patches masked patch prediction "
                                          r"corrupts, and model.mpp=None trains the classifier; set model.mpp, or "
                                          r"leave it at 0.5"):
        with_changes(OK, {"model.mpp_rate": 0.25})
    assert ModelConfig(mpp="color", mpp_rate=0.25).mpp_rate == 0.25
    # an MPP run's config fine-tuned: model.mpp=None with the recipe's (default) rate
    assert with_changes(OK, {"model.mpp": "color"}).model.mpp_rate == 0.5
    for name in list_recipes():  # no recipe sets a rate without model.mpp
        load_recipe(name)


@pytest.mark.parametrize("changes, match", [
    ({"optim.loss": "sigmoid_xent"}, r"^optim.loss='sigmoid_xent': a classifier's loss setting, and masked patch "
                                     r"prediction \(model.mpp='color'\) trains no classifier: its loss is its own; "
                                     r"leave it at 'softmax_xent'$"),
    ({"augment.label_smoothing": 0.1}, r"^augment.label_smoothing=0.1: a classifier's loss setting, .* leave it at 0.0$"),
    ({"model.pre_logits": True}, r"^model.pre_logits=True: a pre-logits layer is the classifier head's, and masked "
                                 r"patch prediction \(model.mpp='color'\) predicts from the patch tokens, so it would "
                                 r"be saved untrained; leave it out$"),
    ({"model.representation_size": 16}, r"^model.representation_size=16: a pre-logits layer is the classifier"),
])
def test_a_classifier_setting_is_refused_for_masked_patch_prediction(changes, match):
    # MPP's loss is its own, from the patch tokens: each was accepted, and the run trained as without it
    with pytest.raises(ConfigError, match=match):
        with_changes(OK, {"model.mpp": "color", **changes})
    with pytest.raises(ConfigError, match=match.split(":")[0]):  # whichever is set first
        with_changes(with_changes(OK, changes), {"model.mpp": "color"})
    assert with_changes(OK, {"model.mpp": "color"}).model.mpp == "color"


@pytest.mark.parametrize("changes, match", [
    ({"model.mpp": "color", "model.patch_dropout": 0.5},
     r"^model.patch_dropout=0.5: masked patch prediction \(model.mpp='color'\) needs every patch"),
    ({"model.mpp": "color4x4", "model.patch_size": 2}, r"^model.mpp='color4x4' needs patches divisible by 4"),
    ({"model.mpp": "color", "model.patch_size": 1, "model.resnet": {"layers": (), "img_size": 8}},
     r"^model.mpp='color' needs a plain ViT: a hybrid's patches \(model.resnet\)"),
    ({"model.posemb_init": "sincos", "model.posemb": "learned_2d"}, r"^model.posemb_init='sincos': needs one learned"),
    ({"model.posemb_init": "sincos", "model.width": 18, "model.num_heads": 2},
     r"^model.posemb_init='sincos': the 2D sin-cos table .* width=18 is not divisible by 4"),
    ({"model.patch_init": "whiten", "model.patch_size": 1, "model.resnet": {"layers": (), "img_size": 8}},
     r"^model.patch_init='whiten': only a plain ViT's"),
    ({"model.name": "BiT-R50x1", "model.attn_init": "mimetic"}, r"^model.attn_init='mimetic': the model has no ViT"),
])
def test_what_mpp_and_the_initialisations_need_of_the_model_is_refused_before_the_data(changes, match):
    # refused by the model built after the run's data was read (--show-config printed the config)
    with pytest.raises(ConfigError, match=match):
        with_changes(OK, changes)


def test_mixing_a_micro_batch_of_one_image_is_refused(tiny):
    # mixup and CutMix mix each image with another of its micro-batch: with one, each was mixed with itself
    one = {"optim.batch_size": 4, "optim.accum_steps": 4, "augment.mixup_alpha": 0.8}
    with pytest.raises(ConfigError, match=r"^augment.mixup_alpha=0.8: mixes each image with another of its "
                                          r"micro-batch, and this run's is 1 image \(optim.batch_size=4 over "
                                          r"optim.accum_steps=4 x 1 process\(es\)\): each would be mixed with itself"):
        check_can_run(with_changes(OK, one))
    with pytest.raises(ConfigError, match=r"^augment.mixup_alpha=0.8 and augment.cutmix_alpha=1.0: mix each image"):
        check_can_run(with_changes(OK, {**one, "augment.cutmix_alpha": 1.0}), world_size=1)
    check_can_run(with_changes(OK, {**one, "optim.accum_steps": 2}))
    with pytest.raises(ConfigError, match=r"^augment.cutmix_alpha=1.0: mixes .* over optim.accum_steps=1 x 2 proc"):
        check_can_run(with_changes(OK, {"optim.batch_size": 2, "augment.cutmix_alpha": 1.0}), world_size=2)
    # an accumulation left to "auto" is checked once decided, before the data is read
    from vitlab.train import train

    with pytest.raises(ConfigError, match=r"^augment.mixup_alpha=0.8: mixes .* \(optim.batch_size=1 over "
                                          r"optim.accum_steps=1 x 1"):
        train(tiny("mixed", batch_size=1, accum_steps="auto", mixup_alpha=0.8), verbose=False)


def test_keeping_an_inits_pre_logits_is_refused_without_an_init():
    # model.keep_pre_logits is read when model.init is loaded only: from scratch it was accepted and did nothing
    with pytest.raises(ConfigError, match=r"^model.keep_pre_logits=True: keeps model.init's pre-logits layer, and this "
                                          r"model is trained from scratch \(model.init=None\); a pre-logits layer of "
                                          r"its own is model.pre_logits"):
        with_changes(OK, {"model.keep_pre_logits": True})
    assert ModelConfig(init="weights.npz", keep_pre_logits=True).keep_pre_logits
    # and model.pre_logits is read from scratch only: with an init it was accepted, and the init's layer dropped
    with pytest.raises(ConfigError, match=r"^model.pre_logits=True: adds a pre-logits layer to a model trained from "
                                          r"scratch, and this one is fine-tuned from model.init, whose architecture it "
                                          r"keeps; model.keep_pre_logits keeps the init's own$"):
        with_changes(load_recipe("paper_pretrain"), {"model.init": "weights.npz"})
    assert with_changes(load_recipe("paper_pretrain"), {"model.init": "weights.npz", "model.pre_logits": False,
                                                        "model.keep_pre_logits": True}).model.keep_pre_logits
    for name in list_recipes():  # no recipe keeps pre-logits without an init
        load_recipe(name)


def test_the_data_decides_the_class_count_and_the_channels():
    # the head was made for the data's classes whatever model.num_classes said (recorded, never built), and an
    # in_chans other than 3 failed at the first step on the RGB images with a message naming no field
    with pytest.raises(ConfigError, match=r"^model.num_classes=5: the head has one output per class of the data"):
        with_changes(OK, {"model.num_classes": 5})
    with pytest.raises(ConfigError, match=r"^model.in_chans=1: the training images are decoded to 3 channels"):
        with_changes(OK, {"model.in_chans": 1})
    assert with_changes(OK, {"model.in_chans": 3}).model.overrides["in_chans"] == 3
    # a key that is not a name was a TypeError ("keywords must be strings")
    with pytest.raises(ConfigError, match=r"^model.overrides=\{1: 2\}: expected a dict of ViTConfig fields by name"):
        with_changes(OK, {"model.overrides": {1: 2}})


def test_a_pre_logits_layer_keeps_a_representation_size_set_by_name():
    # paper_pretrain's pre-logits layer is the width's; a representation_size set by name was replaced by it
    cfg = apply_overrides(load_recipe("paper_pretrain"), ["model.representation_size=256"])
    assert architecture(cfg, 10).representation_size == 256
    assert architecture(load_recipe("paper_pretrain"), 10).representation_size == 768


def test_an_architecture_field_is_refused_for_a_fine_tune():
    # the fine-tuned model is its init's with only the regularisation changed: model.width=64 was recorded and
    # the model kept the init's width
    with pytest.raises(ConfigError, match=r"^model.width=64: the architecture of a fine-tuned model is its init's "
                                          r"\(model.init\); of its fields only dropout, attention_dropout, drop_path, "
                                          r"patch_dropout apply"):
        with_changes(OK, {"model.init": "weights.npz", "model.width": 64})
    tuned = with_changes(OK, {"model.init": "weights.npz", "model.dropout": 0.1, "model.drop_path": 0.1})
    assert tuned.model.overrides["dropout"] == 0.1
    assert with_changes(tuned, {"model.attention_dropout": 0.1}).model.overrides["attention_dropout"] == 0.1
    with pytest.raises(ConfigError, match=r"^model.num_classes=3: the architecture of a fine-tuned model"):
        with_changes(tuned, {"model.num_classes": 3})


def test_an_optimisers_setting_is_refused_with_another_optimiser():
    # Adam reads no momentum, SGD no betas: --set optim.momentum=0.5 on an Adam recipe trained as before
    for changes, message in (({"momentum": 0.5}, r"optim.momentum=0.5: applies to optim.optimizer='sgd' only \(here "
                                                 r"'adam'\); leave it at 0.9"),
                             ({"optimizer": "sgd", "betas": (0.5, 0.9)}, r"optim.betas=\(0.5, 0.9\): applies to "
                                                                       r"optim.optimizer='adam' or 'muon' only"),
                             ({"optimizer": "adam", "muon_momentum": 0.9}, r"optim.muon_momentum=0.9: applies to "
                                                                          r"optim.optimizer='muon' only")):
        with pytest.raises(ConfigError, match=rf"^{message}"):
            OptimConfig(**changes)
    OptimConfig(optimizer="sgd", momentum=0.0)
    OptimConfig(optimizer="muon", betas=(0.8, 0.9), muon_momentum=0.9)
    for name in list_recipes():  # no recipe sets another optimiser's field
        load_recipe(name)


def test_the_end_of_a_decay_is_refused_without_one():
    # optim.decay='constant' keeps the peak lr: a changed optim.min_lr was accepted and never reached
    with pytest.raises(ConfigError, match=r"^optim.min_lr=1e-05: where the decay ends, and optim.decay='constant' keeps "
                                          r"optim.lr to the last step; set optim.decay to 'cosine' or 'linear', or "
                                          r"leave it at 0.0$"):
        with_changes(OK, {"optim.decay": "constant", "optim.min_lr": 1e-5})
    assert with_changes(OK, {"optim.decay": "linear", "optim.min_lr": 1e-5}).optim.min_lr == 1e-5


def test_the_augmentation_fields_are_declared_once():
    # the section and the transform are both the one declaration, Augmentation, and share its checks
    assert issubclass(AugmentConfig, Augmentation) and issubclass(TrainTransform, Augmentation)
    ours = {f.name: f.default for f in dataclasses.fields(AugmentConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(TrainTransform) if f.name not in ("num_classes",
                                                                                              "image_size")}
    assert ours == theirs == {f.name: f.default for f in dataclasses.fields(Augmentation)}
    transform = AugmentConfig(crop="pad", flip=False).transform(num_classes=3, image_size=(8, 8))
    assert (transform.crop, transform.flip, transform.num_classes, transform.image_size) == ("pad", False, 3, (8, 8))
    refused("augment.flip='no'", lambda: AugmentConfig(flip="no"))  # the section names its fields
    refused("^flip='no'", lambda: TrainTransform(num_classes=3, crop="none", flip="no"))  # the transform, its own


def test_alternate_flip_without_flip_is_refused():
    """alternate_flip changes how flip mirrors: with flip=False (the demo recipe's) it was taken and nothing
    was mirrored; both set, as one override or two, it runs."""
    flipless = apply_overrides(OK, ["augment.flip=false"])
    refused(r"^augment.alternate_flip=True: .*needs flip=True",
            lambda: apply_overrides(flipless, ["augment.alternate_flip=true"]))
    refused(r"^alternate_flip=True", lambda: TrainTransform(num_classes=3, crop="none", flip=False, alternate_flip=True))
    both = apply_overrides(flipless, ["augment.alternate_flip=true", "augment.flip=true"]).augment
    assert both.flip and both.alternate_flip


def test_a_recipe_is_a_module_of_the_package_or_a_file(tmp_path):
    import importlib

    from vitlab.configs import recipe_module

    assert recipe_module("demo") is importlib.import_module("vitlab.configs.demo")  # imported, not executed anew
    own = tmp_path / "mine.py"
    own.write_text("from vitlab.configs import load_recipe\n\n"
                   "def get_config(lr='0.5'):\n"
                   "    from vitlab.train.overrides import with_changes\n"
                   "    return with_changes(load_recipe('demo'), {'recipe': 'mine', 'optim.lr': float(lr)})\n")
    assert load_recipe(f"{own}:lr=0.25").optim.lr == 0.25 and load_recipe(str(own)).recipe == "mine"
    with pytest.raises(ConfigError, match="no such recipe file"):
        load_recipe(str(tmp_path / "missing.py"))
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="defines no get_config"):
        load_recipe(str(tmp_path / "empty.py"))
    with pytest.raises(ConfigError, match="recipe 'demo:size=3': unknown option 'size'; demo takes no options"):
        load_recipe("demo:size=3")  # an option the recipe does not take
    with pytest.raises(ConfigError, match="unknown option 'modle'; cifar10_scratch takes model, device"):
        load_recipe("cifar10_scratch:modle=vit")  # named in the recipe's words, not Python's TypeError
    with pytest.raises(ConfigError, match=r"unknown option 'size'; \S*mine\.py takes lr$"):
        load_recipe(f"{own}:size=3")
    # an option without a value was the value "", one given twice took the last, a misspelt true was false
    with pytest.raises(ConfigError, match=r"^recipe 'cifar10_scratch:model': 'model' is not key=value; "
                                          r"cifar10_scratch takes model, device$"):
        load_recipe("cifar10_scratch:model")
    with pytest.raises(ConfigError, match=r"^recipe 'cifar10_scratch:=vit': '=vit' is not key=value"):
        load_recipe("cifar10_scratch:=vit")
    with pytest.raises(ConfigError, match=r"^recipe 'cifar10_scratch:model=vit,model=hybrid': option 'model' given "
                                          r"twice$"):
        load_recipe("cifar10_scratch:model=vit,model=hybrid")
    with pytest.raises(ConfigError, match=r"^recipe 'vtab1k:final=ture': final='ture': allowed values are true, "
                                          r"false$"):
        load_recipe("vtab1k:final=ture")
    assert load_recipe("vtab1k:final=True").data.val_split == 0 and load_recipe("vtab1k:final=no").data.val_split == 200
    assert load_recipe("cifar10_scratch:").recipe == load_recipe("cifar10_scratch").recipe
    # a model named both in the recipe's options and by --model: the option was dropped without a word
    with pytest.raises(ConfigError, match=r"^recipe 'paper_pretrain:model_name=ViT-L/16': model_name='ViT-L/16', and "
                                          r"the run's model is 'ViT-B/16' \(--model, or a fine-tune's init\); name the "
                                          r"model once$"):
        load_recipe("paper_pretrain:model_name=ViT-L/16", model_name="ViT-B/16")
    assert load_recipe("paper_pretrain:model_name=ViT-L_16", model_name="ViT-L/16").optim.lr == 4e-4
    for recipe in ("paper_pretrain", "paper_pretrain_imagenet"):  # an empty name trained the recipe's default model
        with pytest.raises(ConfigError, match=rf"^recipe '{recipe}:model_name=': model_name='': expected a registry "):
            load_recipe(f"{recipe}:model_name=")


def test_the_training_entry_points_refuse_arguments_of_the_wrong_type_by_name(tmp_path):
    """train('demo'), with_changes(cfg, ['optim.steps=3']) or {3: 3}, and load_recipe(3) failed as
    AttributeErrors ('str' object has no attribute 'run', ...); a recipe file's Path is a recipe."""
    from vitlab.train import train

    for wrong in ("demo", {"optim": {}}, None):
        with pytest.raises(ConfigError, match=r"^cfg=.*: expected a TrainConfig \(vitlab.configs.load_recipe\('demo'\) "
                                              rf"gives one\), got a {type(wrong).__name__}$"):
            train(wrong, verbose=False)
    for wrong in (["optim.steps=3"], {3: 3}):
        with pytest.raises(ConfigError, match=r"^changes=.*: expected a dict of \{'section.field': value\}"):
            with_changes(load_recipe("demo"), wrong)
    with pytest.raises(ConfigError, match="^recipe=3: expected a recipe's name or a path to a .py file, as a string$"):
        load_recipe(3)
    own = tmp_path / "mine.py"
    own.write_text("from vitlab.configs import load_recipe\n\ndef get_config():\n    return load_recipe('demo')\n")
    assert load_recipe(own).recipe == "demo"


def test_overrides_parse_types():
    cfg = apply_overrides(TrainConfig(), ["optim.lr=1", "optim.betas=0.9,0.95", "augment.crop=none",
                                          "model.img_size=48", "augment.flip=false", "model.width=384",
                                          "model.init=none", "data.val_split=0.1", "run.fast=false"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.95) and cfg.augment.crop == "none" and cfg.model.img_size == 48
    assert cfg.augment.flip is False and cfg.run.fast is False
    assert cfg.model.overrides == {"width": 384} and cfg.model.init is None and cfg.data.val_split == 0.1


def test_a_wrong_architecture_field_is_named_with_its_close_names():
    # the unknown name had no suggestion, and a bool's other word named no field ("expected true or false")
    with pytest.raises(ConfigError, match=r"^--set model.widht: 'widht' is neither .*\. Did you mean model.width\? "):
        parse_overrides(TrainConfig(), ["model.widht=64"])
    with pytest.raises(ConfigError, match=r"^model.qkv_bias='2': expected true or false$"):
        parse_overrides(TrainConfig(), ["model.qkv_bias=2"])


def test_a_field_of_auto_or_a_bool_takes_either_word():
    for text, value in (("auto", "auto"), ("true", True), ("off", False), ("False", False)):
        assert apply_overrides(TrainConfig(), [f"run.compile_optimizer={text}"]).run.compile_optimizer == value
    with pytest.raises(ConfigError, match=r"run.compile_optimizer='maybe': expected true or false"):
        apply_overrides(TrainConfig(), ["run.compile_optimizer=maybe"])
    with pytest.raises(ConfigError, match=r"run.compile_optimizer=1: expected \"auto\", True or False"):
        TrainConfig(run=RunConfig(compile_optimizer=1))  # a config file's 1 is not read as true
    with pytest.raises(ConfigError, match=r"run.compile_optimizer=True: not with run.fsdp=True \(FSDP's"):
        RunConfig(compile_optimizer=True, fsdp=True)


def test_every_optional_field_is_set_and_cleared_by_name():
    """A field whose default is None (``Optional[X]``) takes a value of type X from ``--set``, and
    "none" clears it: all of them, model.mpp too (the hand-kept list of their types had left it out)."""
    optional = {f"{name}.{f.name}": f.type for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if f.default is None}
    assert "model.mpp" in optional and "optim.muon_adamw_lr" in optional
    for path, annotation in optional.items():
        value = parse_overrides(TrainConfig(), [f"{path}=7"])[path]
        assert annotation.startswith("Optional[") and type(value).__name__ in annotation[9:-1].split(" | "), \
            (path, value)  # an "auto or a count" field (Optional[int | str]) takes the count
        assert parse_overrides(TrainConfig(), [f"{path}=none"]) == {path: None}
    assert apply_overrides(TrainConfig(), ["model.mpp=color"]).model.mpp == "color"


def test_old_flat_names_still_work_on_the_command_line():
    new = apply_overrides(TrainConfig(), ["optim.lr=0.5", "optim.batch_size=64", "data.source=digits",
                                          "model.name=ViT-S/16", "run.threads=1"])
    old = apply_overrides(TrainConfig(), ["lr=0.5", "batch_size=64", "data=digits", "model=ViT-S/16", "threads=1"])
    assert old == new


def test_an_old_flat_config_loads():
    # a flat config dict as TrainConfig wrote it before the sections (to_dict of the
    # cifar10_scratch recipe), as old checkpoints and run folders' config.json hold it
    flat = json.loads((Path(__file__).parent / "old_flat_config.json").read_text())
    assert set(flat) == set(LEGACY_NAMES)  # every old name is mapped
    cfg = from_dict(flat)
    recipe = load_recipe("cifar10_scratch:model=hybrid")
    assert cfg.run.retain_freed_memory is True and cfg.data.decode_workers == 2  # the old defaults, as that run had
    # the recipe has declared its GPU settings since (run.on_device), which the old config predates
    assert with_changes(cfg, {"run.retain_freed_memory": False, "data.decode_workers": "auto",
                              "run.on_device": recipe.run.on_device}) == recipe
    assert cfg.data.progressive_sizes == ((24, 0.5),) and cfg.optim.betas == (0.9, 0.999)
    assert cfg.model.overrides["resnet"]["layers"] == (1, 3)
    for old, new in LEGACY_NAMES.items():
        assert new in field_names(), (old, new)
    with pytest.raises(ConfigError, match="optim.lr_rate"):
        from_dict({**to_dict(recipe), "optim": {**to_dict(recipe)["optim"], "lr_rate": 1}})


def test_to_dict_round_trips_through_json():
    for name in list_recipes():
        cfg = load_recipe(name)
        assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg
        assert set(to_dict(cfg)) == {"recipe", *SECTIONS}


def test_every_recipe_loads_and_is_consistent():
    names = list_recipes()
    assert {"paper_pretrain", "paper_pretrain_imagenet", "paper_finetune", "vtab1k", "cifar10_scratch",
            "demo"} <= set(names)
    for name in names:
        check_can_run(load_recipe(name), need_data=False)
    pre = load_recipe("paper_pretrain")
    o = pre.optim
    assert (o.batch_size, o.weight_decay, o.warmup, o.decay, o.clip_norm) == (4096, 0.1, 10_000, "linear", 1.0)
    assert o.betas == (0.9, 0.999) and pre.model.pre_logits
    i21k = load_recipe("paper_pretrain:dataset=i21k")
    assert i21k.model.overrides["dropout"] == 0.1 and i21k.optim.weight_decay == 0.03
    inet = load_recipe("paper_pretrain_imagenet")
    assert (inet.optim.lr, inet.optim.decay, inet.optim.weight_decay, inet.model.overrides["dropout"]) == (
        3e-3, "cosine", 0.3, 0.1)
    assert inet.optim.steps == 93_835  # 300 epochs of ImageNet-1k's 1,281,167 training images at batch 4096
    # the warm-up, which Table 4 does not give: big_vision's transfer config of these sets (and BiT-HyperRule's,
    # whose schedule lengths Table 4's steps are): Pets and Flowers warmed up 50 steps, a rule of vitlab's own
    for dataset, steps, warmup in (("cifar10", 10_000, 500), ("cifar100", 10_000, 500), ("imagenet", 20_000, 500),
                                   ("pets", 500, 100), ("flowers", 500, 100)):
        ft = load_recipe(f"paper_finetune:dataset={dataset}").optim
        assert (ft.steps, ft.warmup, ft.optimizer, ft.momentum, ft.batch_size, ft.weight_decay, ft.decay) == (
            steps, warmup, "sgd", 0.9, 512, 0.0, "cosine")
    assert load_recipe("paper_finetune").optim.lr_grid == (0.001, 0.003, 0.01, 0.03)
    vtab = load_recipe("vtab1k")
    assert (vtab.optim.lr, vtab.optim.steps, vtab.data.train_examples, vtab.data.val_split) == (0.01, 2500, 1000, 200)
    assert load_recipe("vtab1k:final=true").data.val_split == 0
    for variant, tokens, norm in (("hybrid", 16, "batch"), ("hybrid_bit", 16, "group"), ("vit", 64, None)):
        cifar = load_recipe(f"cifar10_scratch:model={variant}")  # every CIFAR model builds, at 32 px
        check_can_run(cifar, need_data=False)
        built = architecture(cifar, num_classes=10)
        assert built.num_patches == tokens
        assert (built.resnet.norm if built.resnet else None) == norm
    with pytest.raises(ConfigError, match="model='resnet'"):
        load_recipe("cifar10_scratch:model=resnet")
    with pytest.raises(ConfigError, match="no such recipe"):
        load_recipe("paper_pretrian")


def test_the_cifar_recipe_fits_its_batch_cadence_and_model_to_the_device():
    import math

    from vitlab.eval.features import tta_view_prefixes

    for variant in ("hybrid", "vit"):
        cpu = load_recipe(f"cifar10_scratch:model={variant},device=cpu")
        gpu = load_recipe(f"cifar10_scratch:model={variant},device=cuda")
        assert gpu.optim.batch_size == 512 and gpu.run.device == "cuda" and gpu.run.compile
        # the stated rule: lr scaled by the square root of the batch ratio
        assert gpu.optim.lr == pytest.approx(cpu.optim.lr * math.sqrt(512 / cpu.optim.batch_size))
        assert gpu.data.progressive_sizes == ()  # one input shape: a step captured once as a CUDA graph
        assert gpu.run.eval_every == 2000 and gpu.optim.optimizer == cpu.optim.optimizer
        # device=auto (the default) declares both: the CPU's settings, and the GPU's for a run that
        # resolves to one (tests/train/test_resolve.py resolves it on described machines)
        auto = load_recipe(f"cifar10_scratch:model={variant}")
        assert with_changes(auto, {"run.on_device": {}}) == cpu
        on_gpu = with_changes(cpu, auto.run.on_device["cuda"])
        assert on_gpu.optim == gpu.optim and on_gpu.data == gpu.data and on_gpu.run.compile
        assert on_gpu.model == gpu.model
    # the hybrids keep their model; the plain ViT is wider and deeper on a GPU, with the same kind
    # of locality prior, and its docstring's figures are the built models'
    assert load_recipe("cifar10_scratch:model=hybrid,device=cuda").model == load_recipe("cifar10_scratch:model=hybrid").model
    sizes = {}
    for device in ("cpu", "cuda"):
        cfg = load_recipe(f"cifar10_scratch:model=vit,device={device}")
        built = architecture(cfg, num_classes=10)
        assert built.patch_size == (4, 4) and built.num_patches == 64
        assert built.attn_bias == "distance_no_self" and built.attn_offsets
        sizes[device] = (built.width, built.depth, built.num_heads, built.mlp_dim, model_flops(built))
    assert sizes["cpu"][:4] == (192, 6, 8, 384) and sizes["cuda"][:4] == (384, 7, 12, 1536)
    assert round(3 * sizes["cpu"][4] / 1e9, 2) == 0.74 and round(3 * sizes["cuda"][4] / 1e9, 1) == 4.9
    # the many more epochs of a GPU run: the plain ViT adds RandAugment there, the hybrids keep the CPU's augmentation
    assert load_recipe("cifar10_scratch:model=vit").augment.randaug_ops == 0
    gpu_augment = load_recipe("cifar10_scratch:model=vit,device=cuda").augment
    assert (gpu_augment.randaug_ops, gpu_augment.randaug_magnitude) == (2, 5.0)
    # ... and mixup/CutMix (DeiT's alphas, one or the other per batch), where a run fits its training images
    assert (gpu_augment.mixup_alpha, gpu_augment.cutmix_alpha, gpu_augment.mix_switch_prob) == (0.8, 1.0, 0.5)
    cpu_augment = load_recipe("cifar10_scratch:model=vit,device=cpu").augment
    assert cpu_augment.mixup_alpha == cpu_augment.cutmix_alpha == 0
    assert gpu_augment.crop == "pad" and gpu_augment.flip and gpu_augment.label_smoothing == 0.1
    # the plain ViT's weight decay: 0.3 on a CPU (measured above 0.2 at equal steps), 0.2 on a GPU (its measured
    # value there); the hybrids' 0.05 on both
    assert {(m, d): load_recipe(f"cifar10_scratch:model={m},device={d}").optim.weight_decay
            for m in ("hybrid", "hybrid_bit", "vit") for d in ("cpu", "cuda")} == {
        ("hybrid", "cpu"): 0.05, ("hybrid", "cuda"): 0.05, ("hybrid_bit", "cpu"): 0.05, ("hybrid_bit", "cuda"): 0.05,
        ("vit", "cpu"): 0.3, ("vit", "cuda"): 0.2}
    assert (load_recipe("cifar10_scratch:model=hybrid,device=cuda").augment
            == load_recipe("cifar10_scratch:model=hybrid").augment)
    # the final evaluation's views: flips x the 2-pixel translations (10) on a CPU; on a GPU the grids of 2 and 1
    # pixels (34) for every model, its 10 and 18 view sets scored in the same pass
    for m in ("hybrid", "hybrid_bit", "vit"):
        cpu_run = load_recipe(f"cifar10_scratch:model={m},device=cpu").run
        gpu_run = load_recipe(f"cifar10_scratch:model={m},device=cuda").run
        assert cpu_run.eval_flip and cpu_run.final_eval_shift == 2 and not cpu_run.final_eval_diagonal
        assert gpu_run.eval_flip and gpu_run.final_eval_shift == (2, 1) and gpu_run.final_eval_diagonal
        assert tta_view_prefixes(True, gpu_run.final_eval_shift, True) == [1, 2, 10, 18, 26, 34]
    # the plain ViT is the default model (it measured ahead of the hybrid in 30 minutes)
    assert load_recipe("cifar10_scratch") == load_recipe("cifar10_scratch:model=vit")
    with pytest.raises(ConfigError, match="device='tpu'"):
        load_recipe("cifar10_scratch:device=tpu")


def test_demo_recipe_is_small():
    demo = load_recipe("demo")
    assert demo.data.source == "digits" and demo.data.val_split > 0 and demo.run.out == "runs/demo"
    check_can_run(demo)


def test_mallopt_and_the_fast_path_defaults():
    assert RunConfig().retain_freed_memory is False and RunConfig().fast is True


def test_changes_are_checked_together():
    # an intermediate combination may be impossible; only the result is checked
    base = with_changes(OK, {"optim.batch_size": 96, "optim.accum_steps": 3})
    changed = apply_overrides(base, ["optim.batch_size=100", "optim.accum_steps=4"])
    assert (changed.optim.batch_size, changed.optim.accum_steps) == (100, 4)
    changed = apply_overrides(OK, ["model.name=ViT-S/16", "model.num_heads=4", "model.width=256"])
    assert changed.model.overrides == {"patch_size": 8, "num_heads": 4, "width": 256}


def test_a_shorter_run_scales_a_count_warmup():
    """The rule (docs/training.md): a fraction is a fraction of any schedule; a count is the
    recipe's warm-up for its steps, kept in proportion when --steps is shorter."""
    finetune = load_recipe("paper_finetune")  # 500 of 10,000 steps
    assert (finetune.optim.warmup, finetune.optim.steps) == (500, 10_000)
    assert with_changes(finetune, {"optim.steps": 10}).optim.warmup == 1  # at least one step
    assert with_changes(finetune, {"optim.steps": 1000}).optim.warmup == 50
    assert with_changes(finetune, {"optim.steps": 20_000}).optim.warmup == 500  # longer: the count stays
    pretrain = apply_overrides(load_recipe("paper_pretrain"), ["optim.steps=5170"])  # 10k of 517k steps
    assert pretrain.optim.warmup == 100
    demo = with_changes(load_recipe("demo"), {"optim.steps": 10})  # a fraction: untouched
    assert demo.optim.warmup == 0.1 and warmup_steps(demo.optim, 10) == 1
    # both set explicitly: taken as given, and an impossible pair is refused
    assert with_changes(finetune, {"optim.steps": 100, "optim.warmup": 30}).optim.warmup == 30
    refused("optim.warmup", lambda: with_changes(finetune, {"optim.steps": 100, "optim.warmup": 500}))
    # a schedule fitted to a time limit, shorter than optim.steps, scales it too
    assert warmup_steps(finetune.optim, 10_000) == 500 and warmup_steps(finetune.optim, 200) == 10


def test_finetune_with_a_few_steps_from_the_command_line(tiny_checkpoint, capsys):
    from vitlab.cli import main

    assert main(["finetune", "--init", tiny_checkpoint, "--data", "D", "--steps", "10", "--show-config"]) == 0
    optim = json.loads(capsys.readouterr().out)["optim"]
    assert (optim["steps"], optim["warmup"]) == (10, 1)


def test_worker_counts_are_auto_or_counts_and_val_data_comes_with_its_flag():
    from vitlab.cli import build_parser
    from vitlab.cli.train import resolve_config

    cfg = apply_overrides(TrainConfig(), ["data.stream_workers=3", "data.decode_workers=auto"])
    assert cfg.data.stream_workers == 3 and cfg.data.decode_workers == "auto"
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError, match="data.stream_workers"):
            apply_overrides(TrainConfig(), [f"data.stream_workers={bad}"])
    args = build_parser().parse_args(["train", "--recipe", "cifar10_scratch", "--val-data", "val/"])
    cfg = resolve_config(args)
    assert cfg.data.val_data == "val/" and cfg.data.val_split == 0  # it replaces the recipe's 5000
    assert with_changes(load_recipe("cifar10_scratch"), {"data.val_data": "val/"}).data.val_split == 0  # the library too
    args = build_parser().parse_args(["train", "--recipe", "cifar10_scratch", "--val-data", "val/", "--val-split", "9"])
    with pytest.raises(ConfigError, match="data.val_data"):
        resolve_config(args)


def test_an_auto_or_count_field_reads_a_count_whatever_order_its_union_comes_in(monkeypatch):
    """data.stream_workers (``int | str``) reads "3" as the count 3 and "auto" as the word, with its
    union's members in either order (a whole CI run once read model.img_size's "48" as text)."""
    from vitlab.train import overrides

    for annotation in (int | str, str | int):
        monkeypatch.setitem(overrides.FIELD_TYPES, "data.stream_workers", annotation)
        assert parse_overrides(TrainConfig(), ["data.stream_workers=3"]) == {"data.stream_workers": 3}
        assert parse_overrides(TrainConfig(), ["data.stream_workers=auto"]) == {"data.stream_workers": "auto"}
    assert "data.stream_workers" in overrides.AUTO_OR_COUNT and "optim.accum_steps" in overrides.AUTO_OR_COUNT


@pytest.mark.parametrize("text, size", [("48", 48), ("16x24", (16, 24)), ("16X24", (16, 24)), ("16,24", (16, 24)),
                                        ("(16, 24)", (16, 24)), ("[16, 24]", (16, 24)), ("24x24", 24),
                                        ("auto", "auto"), ("none", None)])
def test_model_img_size_takes_n_or_hxw_as_img_size_does(text, size):
    """--set model.img_size=16x24 was refused ('expected a positive number of pixels') and a recipe's or a
    config file's (16, 24) too, where --img-size 16x24 of export and convert took it; a square pair is N."""
    assert parse_overrides(TrainConfig(), [f"model.img_size={text}"]) == {"model.img_size": size}
    cfg = apply_overrides(OK, [f"model.img_size={text}"]) if size not in ("auto", None) else None
    if cfg is not None:
        assert cfg.model.img_size == size
        assert from_dict(json.loads(json.dumps(to_dict(cfg)))).model.img_size == size  # a run's config.json
        listed = size if isinstance(size, int) else list(size)  # a config file's JSON list
        assert ModelConfig(name="ViT-Ti/16", overrides={"patch_size": 8}, img_size=listed).img_size == size
    # from scratch, the model is built at that size: the training size is the pair
    if isinstance(size, tuple):
        assert training_size(apply_overrides(OK, [f"model.img_size={text}"])) == (16, 24)


@pytest.mark.parametrize("value", ["16x0", "abc", "16x24x3", "-3", 0, (16, 0), (16, 24, 3), 1.5, True])
def test_a_bad_model_img_size_is_refused_naming_the_forms(value):
    forms = 'expected a positive size N or HxW, e.g. 384 or 384x512, "auto"'
    with pytest.raises(ConfigError, match=rf"^model.img_size=.*: {re.escape(forms)}"):
        if isinstance(value, str):
            parse_overrides(TrainConfig(), [f"model.img_size={value}"])
        else:
            ModelConfig(name="ViT-Ti/16", img_size=value)


@pytest.mark.parametrize("field", ["data.source", "data.val_data", "data.cache_dir", "model.init"])
def test_an_empty_path_is_refused_not_read_as_the_working_folder(field, capsys):
    """`--data "$DATA"` with DATA unset trained on the working folder, whatever it held, and an empty
    data.cache_dir wrote the decoded cache there."""
    with pytest.raises(ConfigError, match=rf"^{field}='': expected a path or None; an empty one would be the "
                                          "working folder$"):
        apply_overrides(OK, [f"{field}="])
    from vitlab.cli import main

    assert main(["train", "--recipe", "demo", "--data", "", "--show-config"]) == 2
    assert capsys.readouterr().err.startswith("vitlab train: error: data.source='': expected a path or None")


def test_a_model_named_with_an_init_of_another_model_is_refused(tiny_checkpoint, capsys):
    """A fine-tune trains its init's architecture: a --model naming another was dropped without a word
    (a vitlab file; an official .npz is checked as it is read), while a recipe with per-model rates
    took the named model's."""
    from vitlab.cli import main

    command = ["finetune", "--init", tiny_checkpoint, "--data", "D", "--steps", "10", "--show-config"]
    assert main([*command, "--model", "ViT-B/16"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab finetune: error: model.name='ViT-B/16': model.init={tiny_checkpoint!r} holds 'ViT-Ti/16'; a "
        "fine-tune trains its init's architecture: leave --model out, or name that one")
    assert main([*command, "--model", "ViT-Ti/16"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "ViT-Ti/16"
    assert main(command) == 0  # not named: the init's


def test_a_recipe_with_per_model_rates_takes_its_inits_row_unnamed(tmp_path, capsys):
    """paper_pretrain's Table 3 rates are per model: with --model the named model's row was taken, without it the
    recipe's ViT-B/16 row for any init, so a ViT-L/32 init trained at B/16's 8e-4 (its own 6e-4) and the config
    recorded model_name=ViT-B/16 beside the model ViT-L/32.  The init's model picks the row, as --model does."""
    import vitlab
    from vitlab.cli import main

    vitlab.save_model(vitlab.create_model("ViT-L/32", img_size=16, patch_size=8, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10), tmp_path / "l32")
    nameless = vitlab.models.vit.ViTConfig(img_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32)
    vitlab.save_model(vitlab.create_model(nameless), tmp_path / "nameless")
    command = ["finetune", "--recipe", "paper_pretrain", "--data", "D", "--steps", "10", "--set",
               "model.pre_logits=false", "--show-config", "--init"]
    for init, lr, recipe in (("l32", 6e-4, "model_name=ViT-L/32"), ("nameless", 8e-4, "model_name=ViT-B/16")):
        assert main([*command, str(tmp_path / init)]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["optim"]["lr"], shown["recipe"]) == (lr, f"paper_pretrain:dataset=jft,{recipe},epochs=7")
    assert main([*command, str(tmp_path / "l32"), "--model", "ViT-L/32"]) == 0
    assert json.loads(capsys.readouterr().out)["optim"]["lr"] == 6e-4
    command[2] = "paper_pretrain:model_name=ViT-B/16"  # another model's row named in the recipe, as --model would
    assert main([*command, str(tmp_path / "l32")]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitlab finetune: error: recipe 'paper_pretrain:model_name=ViT-B/16': model_name='ViT-B/16', and the run's "
        "model is 'ViT-L/32' (--model, or a fine-tune's init); name the model once")


def test_the_library_takes_a_recipes_row_by_its_inits_model_as_the_commands_do(tmp_path):
    """load_recipe (the Python API) gave paper_pretrain with a ViT-L/32 init Table 3's ViT-B/16 row, 8e-4 (its
    own 6e-4), recorded as model_name=ViT-B/16 beside the model ViT-L/32: only the command line took the init's
    row.  load_recipe's changes name the init, and it takes the row the commands take, by the one rule."""
    import vitlab

    vitlab.save_model(vitlab.create_model("ViT-L/32", img_size=16, patch_size=8, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10), tmp_path / "l32")
    nameless = vitlab.models.vit.ViTConfig(img_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32)
    vitlab.save_model(vitlab.create_model(nameless), tmp_path / "nameless")
    tune = {"model.pre_logits": False, "optim.steps": 10}
    for init, lr, recipe in (("l32", 6e-4, "model_name=ViT-L/32"), ("nameless", 8e-4, "model_name=ViT-B/16")):
        cfg = load_recipe("paper_pretrain", changes={**tune, "model.init": str(tmp_path / init)})
        assert (cfg.optim.lr, cfg.recipe) == (lr, f"paper_pretrain:dataset=jft,{recipe},epochs=7"), init
        assert cfg.optim.steps == 10 and cfg.model.pre_logits is False  # the changes made, over the row's
    l32 = {**tune, "model.init": str(tmp_path / "l32")}
    assert load_recipe("paper_pretrain", changes={**l32, "optim.lr": 1e-4}).optim.lr == 1e-4
    assert load_recipe("paper_pretrain", "ViT-L/32", changes=l32).optim.lr == 6e-4
    with pytest.raises(ConfigError, match=r"^model.name='ViT-B/16': model.init=.* holds 'ViT-L/32'; a fine-tune "):
        load_recipe("paper_pretrain", changes={**l32, "model.name": "ViT-B/16"})
    with pytest.raises(ConfigError, match=r"^recipe 'paper_pretrain:model_name=ViT-B/16': model_name='ViT-B/16', "
                                          r"and the run's model is 'ViT-L/32'"):
        load_recipe("paper_pretrain:model_name=ViT-B/16", changes=l32)
    assert load_recipe("demo", changes={"optim.steps": 3}).optim.steps == 3  # a recipe of one row


def test_a_name_given_with_a_hybrid_or_bit_init_is_checked_as_a_load_checks_it(tmp_path, capsys):
    """--model with an init was compared field by field: a hybrid's stem with its img_size, so R50+ViT-B/16 was
    refused for its own model at 384 px; a BiT's by ViT fields it has none of, so any BiT name passed."""
    import safetensors.torch
    import torch

    from vitlab.cli import main
    from vitlab.config import config_to_json
    from vitlab.models.registry import get_config
    from vitlab.weights import infer_config
    from vitlab.weights.core import meta_shapes

    def init(name, cfg):  # what the command reads is the config alone (load_config): a file with it, no weights
        safetensors.torch.save_file({"x": torch.zeros(1)}, tmp_path / name,
                                    metadata={"vitlab_config": config_to_json(cfg)})
        return ["finetune", "--init", str(tmp_path / name), "--data", "D", "--steps", "10", "--show-config"]

    # an R50+ViT-B/16 as a load at 384 px reads it (from its shapes alone: no memory held)
    shapes = {k: torch.zeros(()).expand(s) for k, s in meta_shapes(get_config("R50+ViT-B/16", img_size=384)).items()}
    assert main([*init("r50.safetensors", infer_config(shapes, name="R50+ViT-B/16")), "--model", "R50+ViT-B/16"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "R50x1+ViT-B/16"
    command = init("bit.safetensors", get_config("BiT-R50x1"))
    assert main([*command, "--model", "BiT-R152x4"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab finetune: error: model.name='BiT-R152x4': model.init={str(tmp_path / 'bit.safetensors')!r} holds "
        "'BiT-R50x1'; a fine-tune trains its init's architecture: leave --model out, or name that one")
    assert main([*command, "--model", "R50x1"]) == 0  # big_transfer's own spelling of it


def test_a_val_split_that_is_not_a_number_is_named_by_its_field(capsys):
    """--set data.val_split=[1,2] was a TypeError traceback from the count's conversion."""
    from vitlab.cli import main

    assert main(["train", "--recipe", "demo", "--set", "data.val_split=[1,2]", "--show-config"]) == 2
    assert capsys.readouterr().err.strip() == ("vitlab train: error: data.val_split=(1, 2): a count (integer >= 1), a "
                                              "fraction in (0, 1), or 0 for none")
    assert main(["train", "--recipe", "demo", "--val-split", "300.0", "--show-config"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["val_split"] == 300


def test_an_augmentation_setting_a_devices_form_reads_is_accepted():
    """cifar10_scratch's GPU form turns on mixup and CutMix (run.on_device): its choice between them,
    mix_switch_prob, was refused on the CPU form the config is built in, so the recipe's GPU run could
    not set it; a setting no form reads is still refused, and a form that does not read it trains
    with the default (it does nothing there)."""
    from vitlab.configs import load_recipe
    from vitlab.train.overrides import with_changes

    cfg = with_changes(load_recipe("cifar10_scratch:model=vit"), {"augment.mix_switch_prob": 0.3})
    assert cfg.augment.mix_switch_prob == 0.3 and cfg.augment.mixup_alpha == 0  # the CPU form: no mixing
    assert cfg.augment.transform(10, (32, 32)).mix_switch_prob == 0.5
    gpu = with_changes(cfg, cfg.run.on_device["cuda"])
    assert gpu.augment.transform(10, (32, 32)).mix_switch_prob == 0.3
    with pytest.raises(ConfigError, match=r"^augment\.mix_switch_prob=0\.3: chooses CutMix over mixup"):
        with_changes(load_recipe("demo"), {"augment.mix_switch_prob": 0.3})
    with pytest.raises(ConfigError, match=r"^augment\.crop_scale=\(0\.5, 1\.0\): shapes the inception crop"):
        with_changes(load_recipe("cifar10_scratch:model=vit"), {"augment.crop_scale": (0.5, 1.0)})


def test_a_padding_or_a_magnitude_the_user_sets_where_nothing_reads_it_is_refused():
    """augment.crop_pad with a crop other than 'pad', and augment.randaug_magnitude with randaug_ops=0, were
    accepted and did nothing.  Refused where the value is the user's (one no form of the recipe has), not
    where it is the recipe's own, left by turning its method off: the demo's crop_pad=1 after crop=none,
    cifar10_scratch's GPU magnitude 5 after randaug_ops=0, which the run applies on a GPU."""
    demo = load_recipe("demo")
    with pytest.raises(ConfigError, match=r"^augment\.crop_pad=2: pads the pad-and-crop, and crop='none' is another; "
                                          r"set crop='pad', or leave it at the recipe's 1$"):
        apply_overrides(demo, ["augment.crop=none", "augment.crop_pad=2"])
    with pytest.raises(ConfigError, match=r"^augment\.randaug_magnitude=5: is RandAugment's magnitude, and "
                                          r"randaug_ops=0 turns RandAugment off; set randaug_ops above 0, or leave "
                                          r"it at the recipe's 9\.0$"):
        with_changes(demo, {"augment.randaug_magnitude": 5})
    assert apply_overrides(demo, ["augment.crop=none"]).augment.crop_pad == 1
    assert with_changes(demo, {"augment.crop_pad": 2}).augment.crop_pad == 2  # the pad crop reads it
    assert with_changes(demo, {"augment.randaug_ops": 2, "augment.randaug_magnitude": 5}).augment.randaug_magnitude == 5
    cifar = load_recipe("cifar10_scratch:model=vit")
    no_randaug = with_changes(cifar, {"augment.randaug_ops": 0})
    gpu = with_changes(no_randaug, no_randaug.run.on_device["cuda"])  # as the run resolves on a GPU
    assert (gpu.augment.randaug_ops, gpu.augment.randaug_magnitude) == (0, 5.0)
    assert with_changes(cifar, {"augment.randaug_magnitude": 7}).augment.randaug_magnitude == 7  # its GPU form reads it
    with pytest.raises(ConfigError, match=r"^augment\.randaug_magnitude=7: is RandAugment's magnitude"):
        with_changes(cifar, {"augment.randaug_magnitude": 7, "augment.randaug_ops": 0})
    with pytest.raises(ConfigError, match=r"^augment\.crop_pad=2: pads the pad-and-crop, and crop='inception'"):
        with_changes(cifar, {"augment.crop": "inception", "augment.crop_pad": 2})


def test_an_evaluation_setting_the_user_sets_on_a_run_that_scores_nothing_is_refused():
    """run.eval_every, eval_flip, final_eval_shift... on a run that holds no images out (data.val_split=0, no
    data.val_data), or trains by masked patch prediction, were accepted and did nothing.  Refused where the
    value is the user's, not where it is the recipe's (vtab1k's final run keeps its eval_every) or the default."""
    demo = with_changes(load_recipe("demo"), {"data.val_split": 0})
    for name, value in (("eval_flip", True), ("eval_every", 10), ("final_eval_shift", 2), ("eval_batch_size", 64)):
        with pytest.raises(ConfigError, match=rf"^run\.{name}={value!r}: read by the evaluations of the held-out "
                                              r"images, and this run holds no images out to score \(data\.val_split=0, "
                                              r"data\.val_data=None\); set data\.val_split \(--val-split\) or "
                                              r"data\.val_data \(--val-data\), or leave it at"):
            with_changes(demo, {f"run.{name}": value})
        with pytest.raises(ConfigError, match=rf"^run\.{name}="):  # the split and the setting changed together
            with_changes(load_recipe("demo"), {"data.val_split": 0, f"run.{name}": value})
        assert getattr(with_changes(load_recipe("demo"), {f"run.{name}": value}).run, name) == value  # scored
        assert getattr(with_changes(demo, {"data.val_data": "digits", f"run.{name}": value}).run, name) == value
    assert with_changes(demo, {"run.eval_every": 0}).run.eval_every == 0  # the default: at the end, of nothing
    assert with_changes(demo, {"run.eval_every": 200}).run.eval_every == 200  # the recipe's own
    assert load_recipe("vtab1k:final=true").run.eval_every == 500
    with pytest.raises(ConfigError, match=r"^run\.eval_flip=True: .* masked patch prediction \(model\.mpp='pixels'\) "
                                          r"trains no classifier to score; leave it at False$"):
        with_changes(load_recipe("mpp:target=pixels"), {"run.eval_flip": True})
