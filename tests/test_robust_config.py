"""Impossible and hostile model configurations are refused before any allocation,
with the field, the value and what is allowed in one line."""
import json

import pytest

from vitlab.config import ConfigError, ResNetConfig, ViTConfig, config_from_json
from vitlab.models.registry import closest_models, get_config

TINY = dict(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4, img_size=16, num_classes=3)


@pytest.mark.parametrize("fields, match", [
    (dict(width=30, num_heads=4), r"width=30 is not divisible by num_heads=4: .*num_heads must divide 30 "
                                  r"\(nearest: 3, 5\)"),
    (dict(width=768, num_heads=7), r"nearest: 6, 8\)"),
    (dict(img_size=18), r"img_size=\(18, 18\).*not divisible by patch_size=\(4, 4\) along height; "
                        r"allowed: a multiple of 4, such as 16, 20"),
    (dict(img_size=(16, 18)), r"along width; allowed: a multiple of 4, such as 16, 20"),
    (dict(img_size=3), r"allowed: a multiple of 4, such as 4$"),
    (dict(width=10**9), r"width=1000000000: must be at most 65536"),
    (dict(depth=10**6), r"depth=1000000: must be at most 1024"),
    (dict(mlp_dim=10**9), r"mlp_dim=1000000000: must be at most"),
    (dict(num_classes=10**9), r"num_classes=1000000000: must be at most"),
    (dict(img_size=10**6), r"img_size=1000000: sizes must be at most 16384"),
    (dict(img_size=16384, patch_size=4), r"patches per image; at most"),
    (dict(width=65536, depth=1024, mlp_dim=262144, num_heads=1), r"parameters; at most"),
    (dict(width="768"), r"width='768': must be a positive integer"),
    (dict(width=True), r"width=True: must be a positive integer"),
    (dict(depth=2.0), r"depth=2.0: must be a positive integer"),
    (dict(ln_eps="1e-6"), r"ln_eps='1e-6': must be a number in \[0, 1\)"),
    (dict(ln_eps=float("nan")), r"ln_eps=nan"),
    (dict(qkv_bias="yes"), r"qkv_bias='yes': must be True or False"),
    (dict(dynamic_img_size=1), r"dynamic_img_size=1: must be True or False"),
    (dict(name=7), r"name=7: must be a string or None"),
    (dict(resnet="R50"), r"resnet='R50': must be a ResNetConfig"),
    (dict(classifier="cls"), r"classifier='cls': allowed values are 'token', 'gap'"),
    # a hybrid's stem given as a dict: another field was a TypeError from ResNetConfig's constructor
    (dict(patch_size=1, resnet={"layers": (1,), "zz": 1}), r"^resnet: unknown field\(s\) zz; ResNetConfig's fields: "
                                                          r"gn_eps, img_size"),
    # the stem reads the images: it failed in its first convolution, in the forward
    (dict(patch_size=1, resnet=ResNetConfig(layers=(1,), in_chans=1)),
     r"^resnet.in_chans=1: the hybrid's stem reads the images: must equal in_chans=3$"),
])
def test_impossible_vit_configs(fields, match):
    with pytest.raises(ConfigError, match=match):
        ViTConfig(**{**TINY, **fields})


@pytest.mark.parametrize("fields, match", [
    (dict(layers=(3, 10**6)), r"each in 1..1024"),
    (dict(width_factor=10**6), r"width_factor=1000000: must be at most 64"),
    (dict(gn_eps=-1.0), r"gn_eps=-1.0"),
    (dict(ws_eps_inside_sqrt="no"), r"ws_eps_inside_sqrt='no'"),
])
def test_impossible_resnet_configs(fields, match):
    with pytest.raises(ConfigError, match=match):
        ResNetConfig(**fields)


def test_every_registered_model_passes_the_limits():
    from vitlab.models.registry import list_models

    assert len([get_config(n) for n in list_models()]) == len(list_models())
    get_config("ViT-H/14", img_size=518)  # the largest real settings are well inside


@pytest.mark.parametrize("text, match", [
    ('{"type": "ViTConfig", "width": 1000000000}', "width=1000000000"),
    ('{"type": "ViTConfig", "wdith": 768}', r"unknown field\(s\) wdith"),
    ('{"type": "ViTConfig", "img_size": "224"}', "img_size='224'"),
    ('{"type": "Evil"}', "type='Evil': allowed values are ViTConfig, ResNetConfig"),
    ('{"type": "ViTConfig", "resnet": {"layers": [3, 4], "width_factor": 1e9}}', "width_factor"),
])
def test_config_json_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        config_from_json(text)


@pytest.mark.parametrize("text", ["[]", "3", '"ViT"', "null"])
def test_config_json_that_is_not_an_object(text):
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_json(text)


@pytest.mark.parametrize("name, suggestion", [
    ("ViT-B/15", "'ViT-B/16'"),
    ("vit-b/16", "'ViT-B/16'"),
    ("ViT-L16", "'ViT-L/16'"),
    ("BiT-R50x3", "'BiT-R50x2'"),
    ("R50+ViT-B_16", None),  # an official alias: accepted
])
def test_unknown_model_suggests_the_closest_name(name, suggestion):
    if suggestion is None:
        assert get_config(name).name == "R50x1+ViT-B/16"
        return
    with pytest.raises(ConfigError, match=rf"unknown model '{name}'\. Did you mean {suggestion}"):
        get_config(name)
    assert closest_models(name)[0] == suggestion.strip("'")


def test_far_away_names_get_no_suggestion():
    with pytest.raises(ConfigError) as e:
        get_config("resnet")
    assert "Did you mean" not in str(e.value) and "`vitlab models` lists all" in str(e.value)
    with pytest.raises(ConfigError, match="must be a string"):
        get_config(None)
