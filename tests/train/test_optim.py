import torch

from vitlab.models.registry import create_model
from vitlab.train.config import OptimConfig
from vitlab.train.optim import build_optimizer, no_decay_names, split_decay


def test_only_kernels_decay():
    model = create_model("ViT-Ti/16", img_size=32, patch_size=8, depth=2, representation_size=192, num_classes=10)
    names = set(no_decay_names(model))
    decayed = {n for n, p in model.named_parameters()} - names
    assert "cls_token" in names
    assert any("pos_embed" in n for n in names)
    assert all(n.endswith("bias") or "norm" in n or "pos_embed" in n or n == "cls_token" for n in names), names
    assert all(n.endswith("weight") and "norm" not in n for n in decayed), decayed
    assert {"patch_embed.weight", "head.weight", "pre_logits.fc.weight"} <= decayed
    assert sum(1 for n in decayed if "blocks.0." in n) == 4  # qkv, proj, fc1, fc2 kernels


def test_groups_carry_weight_decay():
    model = create_model("ViT-Ti/16", img_size=32, patch_size=8, depth=1, num_classes=10)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    decay, no_decay = split_decay(model, "all")
    assert not no_decay and len(decay) == len(list(model.parameters()))
    sgd = build_optimizer(model, OptimConfig(optimizer="sgd", momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
