"""Initialisations for training from scratch: ``model.attn_init="mimetic"`` and ``model.posemb_init="sincos"``."""
import math

import pytest
import torch

from vitlab.config import ConfigError
from vitlab.models.init import mimetic_attention_
from vitlab.models.layers import Attention
from vitlab.models.vit import ViTConfig
from vitlab.train.overrides import with_changes

WIDTH, HEADS = 24, 3


def products(attn: Attention) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each head's W_q^T W_k, and W_v^T W_o^T, as the attention computes with them."""
    q, k, v = attn.qkv.weight.double().view(3, WIDTH, WIDTH)
    d = attn.head_dim
    heads = [q[h * d:(h + 1) * d].T @ k[h * d:(h + 1) * d] for h in range(HEADS)]
    return heads, v.T @ attn.proj.weight.double().T


def test_mimetic_products_are_the_truncated_noisy_identities():
    attn = Attention(ViTConfig(width=WIDTH, depth=1, num_heads=HEADS, mlp_dim=48, patch_size=4, img_size=8))
    mimetic_attention_(attn, qk=0.7, vo=0.4, generator=torch.Generator().manual_seed(3))
    heads, value_output = products(attn)

    # the same draws, in the same order, computed by hand
    generator = torch.Generator().manual_seed(3)
    eye = torch.eye(WIDTH, dtype=torch.float64)
    d = WIDTH // HEADS
    for head in heads:
        z = torch.randn(WIDTH, WIDTH, generator=generator, dtype=torch.float64) / math.sqrt(WIDTH)
        u, s, vt = torch.linalg.svd(0.7 * (z + eye))
        expected = u[:, :d] @ torch.diag(s[:d]) @ vt[:d]  # the best rank-d approximation
        assert torch.allclose(head, expected, atol=1e-5)
        assert head.trace() > 0
    z = torch.randn(WIDTH, WIDTH, generator=generator, dtype=torch.float64) / math.sqrt(WIDTH)
    assert torch.allclose(value_output, 0.4 * (z - eye), atol=1e-5)


def test_mimetic_init_makes_tokens_attend_to_themselves():
    torch.manual_seed(0)
    cfg = ViTConfig(width=WIDTH, depth=1, num_heads=HEADS, mlp_dim=48, patch_size=4, img_size=8)
    x = torch.nn.functional.layer_norm(torch.randn(4, 16, WIDTH), (WIDTH,))

    def self_attention(attn: Attention) -> float:
        attn.recorded = []
        with torch.no_grad():
            attn(x)
        return attn.recorded[0].diagonal(dim1=-2, dim2=-1).mean().item()

    plain = Attention(cfg)
    mimetic = mimetic_attention_(Attention(cfg), generator=torch.Generator().manual_seed(0))
    assert self_attention(mimetic) > 2 * self_attention(plain)


def test_mimetic_from_the_config_changes_only_attention(tiny):
    from vitlab.train.build import build

    plain, mimetic = build(tiny()), build(with_changes(tiny("mimetic"), {"model.attn_init": "mimetic"}))
    for (name, a), (_, b) in zip(plain.model.named_parameters(), mimetic.model.named_parameters()):
        changed = not torch.equal(a, b)
        assert changed == (name.endswith(("attn.qkv.weight", "attn.proj.weight"))), name


def test_mimetic_is_refused_where_it_cannot_apply(tiny):
    with pytest.raises(ConfigError, match="model.attn_init"):
        with_changes(tiny(), {"model.attn_init": "identity"})
    with pytest.raises(ConfigError, match="model.attn_init"):
        with_changes(tiny(), {"model.attn_init": "mimetic", "model.init": "weights.safetensors"})


def test_sincos_posemb_init_is_the_2d_table_behind_the_class_token(tiny):
    from vitlab.models.posemb import posemb_sincos_2d
    from vitlab.train.build import build

    plain = build(tiny())
    sincos = build(with_changes(tiny("sincos"), {"model.posemb_init": "sincos"}))
    table = sincos.model.pos_embed.weight
    grid = sincos.model.pos_embed.grid
    assert torch.equal(table[0, 1:], posemb_sincos_2d(grid, table.shape[-1])[0])
    assert torch.equal(table[0, :1], plain.model.pos_embed.weight[0, :1])  # [class] keeps its draw
    for (name, a), (_, b) in zip(plain.model.named_parameters(), sincos.model.named_parameters()):
        assert torch.equal(a, b) == (name != "pos_embed.weight"), name


def test_sincos_posemb_init_is_refused_where_it_cannot_apply(tiny):
    from vitlab.train.build import build

    with pytest.raises(ConfigError, match="model.posemb_init"):
        with_changes(tiny(), {"model.posemb_init": "fourier"})
    # refused as the config is built (the name model.overrides.posemb had been refused as an unknown field)
    with pytest.raises(ConfigError, match=r"^model.posemb_init='sincos': needs one learned 1D position embedding"):
        with_changes(tiny(), {"model.posemb_init": "sincos", "model.posemb": "learned_2d"})


def test_a_sigmoid_run_from_scratch_starts_its_head_bias_at_minus_ln_k_as_big_vision_does(tiny, tmp_path):
    # the head started at zero whatever the loss: under sigmoid_xent every class at p = 0.5, an initial loss of
    # K ln 2 (15,140 on ImageNet-21k's 21,843 classes), where big_vision's vit_i21k.py starts its bias at -10.0
    from vitlab.train.build import build
    from vitlab.train.config import from_dict, to_dict
    from vitlab.train.state import check_same_run
    from vitlab.weights import save_model

    sigmoid = build(tiny("sigmoid", loss="sigmoid_xent")).model  # the digits: 10 classes
    assert torch.equal(sigmoid.head.bias, torch.full((10,), -math.log(10))) and not sigmoid.head.weight.any()
    assert not build(tiny("softmax")).model.head.bias.any()  # a softmax run's is as it was
    chosen = with_changes(tiny("chosen", loss="sigmoid_xent"), {"model.head_bias_init": -3})
    assert torch.equal(build(chosen).model.head.bias, torch.full((10,), -3.0))
    # a fine-tune's head starts at zero (Sec. 3.2; big_vision's transfer configs set no bias), unless set
    save_model(sigmoid, tmp_path / "init.safetensors")
    tune = with_changes(tiny("tune", loss="sigmoid_xent"), {"model.init": str(tmp_path / "init.safetensors"),
                                                            "model.overrides": {}})
    assert not build(tune).model.head.bias.any()
    assert torch.equal(build(with_changes(tune, {"model.head_bias_init": -2.5})).model.head.bias,
                       torch.full((10,), -2.5))
    # refused where it would do nothing: softmax is the same with any bias added to every class; MPP has no classifier
    with pytest.raises(ConfigError, match=r"^model.head_bias_init=-3: starts the head's sigmoid probabilities "
                                          r"\(optim.loss='sigmoid_xent'\), and under optim.loss='softmax_xent'"):
        with_changes(tiny(), {"model.head_bias_init": -3})
    with pytest.raises(ConfigError, match=r"^model.head_bias_init=-3: the classifier head's bias at the start, and "
                                          r"masked patch prediction"):
        with_changes(tiny(), {"model.head_bias_init": -3, "model.mpp": "color"})
    with pytest.raises(ConfigError, match=r"^model.head_bias_init='low': expected a number"):
        with_changes(tiny(), {"model.head_bias_init": "low"})
    # a run recorded before the field (its config.json, its checkpoint's config) reads as None and resumes
    recorded = to_dict(tiny("sigmoid", loss="sigmoid_xent"))
    del recorded["model"]["head_bias_init"]
    assert from_dict(recorded).model.head_bias_init is None
    check_same_run(tiny("sigmoid", loss="sigmoid_xent"), recorded)
