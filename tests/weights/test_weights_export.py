"""vitlab's weights out: Hugging Face, timm and the official layouts, conventions included."""
import json
import warnings

import numpy as np
import pytest
import safetensors
import torch

from test_weights_official import random_checkpoint
from test_weights_sources import to_timm_names
from vitlab.config import ViTConfig, replace
from vitlab.models.registry import build_model
from vitlab.weights import ConventionWarning, WeightsError, load_model, load_official_npz, save_model

TINY = ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=48, num_heads=2, num_classes=5)


def random_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def logits(model, size, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randn(2, model.cfg.in_chans, *size))


def safetensors_keys(path):
    with safetensors.safe_open(str(path), framework="pt") as f:
        return set(f.keys())


# -------------------------------------------------------------------------- Hugging Face

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("fields", [
    dict(),                                                        # vit_jax conventions: tanh GELU, eps 1e-6
    dict(gelu="exact", ln_eps=1e-12, posemb_resample="bicubic"),   # HF's own
    dict(img_size=(16, 24), patch_size=(4, 8), qkv_bias=False),    # non-square, no qkv bias
    dict(img_size=16, patch_size=(4, 8)),                          # a square image of non-square patches: 4x2
], ids=["official-conventions", "hf-conventions", "non-square", "non-square-patches"])
def test_hf_export_loads_strictly_with_equal_logits(tmp_path, fields):
    model = random_model(replace(TINY, **fields))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_model(model, tmp_path / "hf", format="hf")
    # the only thing HF cannot carry is the resampling of position embeddings at other sizes
    assert [issubclass(w.category, ConventionWarning) for w in caught] == \
        ([True] if model.cfg.posemb_resample == "bilinear" else [])
    hf, info = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["hidden_act"] == {"tanh": "gelu_pytorch_tanh", "exact": "gelu"}[model.cfg.gelu]
    assert config["layer_norm_eps"] == model.cfg.ln_eps
    x = torch.randn(3, 3, *model.cfg.img_size)
    with torch.no_grad():
        diff = (hf.eval()(pixel_values=x).logits - model(x)).abs().max()
    assert diff < 1e-4
    # the key names are the ones transformers itself writes for this config
    hf.save_pretrained(tmp_path / "again")
    assert safetensors_keys(tmp_path / "hf" / "model.safetensors") == safetensors_keys(tmp_path / "again" / "model.safetensors")
    # and back into vitlab, conventions from the config.json
    again = load_model(tmp_path / "hf")
    assert (again.cfg.gelu, again.cfg.ln_eps, again.cfg.img_size) == (model.cfg.gelu, model.cfg.ln_eps, model.cfg.img_size)
    assert torch.allclose(logits(again, model.cfg.img_size), logits(model, model.cfg.img_size), atol=1e-6)


@pytest.mark.parametrize("fields, reason", [
    (dict(classifier="gap"), "classifier='gap'"),
    (dict(representation_size=7), "representation_size=7"),
    (dict(posemb="learned_2d"), "posemb='learned_2d'"),
])
def test_hf_export_refuses_what_it_cannot_compute(tmp_path, fields, reason):
    with pytest.raises(WeightsError, match=reason):
        save_model(random_model(replace(TINY, **fields)), tmp_path / "hf", format="hf")


def test_hf_export_writes_the_image_processor_of_vitlab_s_input(tmp_path):
    """The export's image processor scales pixels as vitlab's models read them (p / 127.5 - 1, at the
    model's size): there was none, and a save into a Hugging Face folder left that folder's own
    (ImageNet's mean and std, say), which then described other inputs than the weights'."""
    from vitlab.data.transforms import to_float

    folder = tmp_path / "hf"
    cfg = replace(TINY, img_size=(16, 24), patch_size=(4, 8), posemb_resample="bicubic")
    model = random_model(cfg)
    save_model(random_model(cfg, seed=1), folder, format="hf")
    transformers.ViTImageProcessor(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
                                   ).save_pretrained(folder)
    save_model(model, folder, format="hf")
    pixels = torch.randint(0, 256, (2, 3, 16, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    inputs = processor(images=list(pixels.permute(0, 2, 3, 1).numpy()), return_tensors="pt").pixel_values
    torch.testing.assert_close(inputs, to_float(pixels), atol=1e-6, rtol=0)  # at the model's size: no resize
    with torch.no_grad():
        assert (load_model(folder)(to_float(pixels)) - model(to_float(pixels))).abs().max() < 1e-5


# ---------------------------------------------------------------------------------- timm


def timm_vit_keys(depth, gap=False):
    """timm VisionTransformer.state_dict() names (class_token=False for global_pool='avg', fc_norm=False)."""
    keys = {"pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias",
            "head.weight", "head.bias"} | (set() if gap else {"cls_token"})
    for i in range(depth):
        keys |= {f"blocks.{i}.{m}.{p}" for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
                 for p in ("weight", "bias")}
    return keys


@pytest.mark.parametrize("use_test_size", [False, True])
@pytest.mark.parametrize("img_size", [16, (16, 24)], ids=["square", "non-square"])
def test_timm_export_s_eval_transform_is_vitlab_predict_s(tmp_path, monkeypatch, img_size, use_test_size):
    """The overlay stated mean and std but not crop_pct or interpolation: timm's eval transform took the
    named model's (every ViT's: a centre crop of 0.9, bicubic) and cropped what vitlab's predict resizes
    whole.  timm's own data config of the export (its resolve_data_config and create_transform, transcribed:
    timm is not installed) now gives a model what predict gives it."""
    from PIL import Image

    from helpers.preprocessing import TIMM_VIT_CFG, predict_input, timm_eval_input

    with pytest.warns(ConventionWarning):
        path = save_model(random_model(replace(TINY, img_size=img_size)), tmp_path / "vit.safetensors", format="timm")
    overlay = json.loads((tmp_path / "vit.timm.json").read_text())["pretrained_cfg_overlay"]
    image = tmp_path / "x.png"  # wider and shorter than the model: a crop and a squash differ
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (13, 75, 3), dtype=np.uint8)).save(image)
    timm_input = timm_eval_input({**TIMM_VIT_CFG, **overlay}, image, use_test_size)  # the named model's, overlaid
    torch.testing.assert_close(timm_input, predict_input(path, image, monkeypatch), atol=1e-5, rtol=0)

@pytest.mark.parametrize("fields, suffix", [
    (dict(), ".safetensors"),
    (dict(classifier="gap", gelu="exact", img_size=(16, 24)), ".pth"),
], ids=["token-tanh", "gap-exact-non-square"])
def test_timm_export_round_trips_with_timm_names(tmp_path, fields, suffix):
    model = random_model(replace(TINY, **fields))
    with pytest.warns(ConventionWarning, match="posemb_resample"):  # timm resizes bicubically
        path = save_model(model, tmp_path / f"vit{suffix}", format="timm")
    sd = load_model.__globals__["_torch_load"](path) if suffix == ".pth" else safetensors.torch.load_file(path)
    assert set(sd) == timm_vit_keys(2, gap=model.cfg.classifier == "gap")
    spec = json.loads((tmp_path / "vit.timm.json").read_text())
    kw = spec["kwargs"]
    # no timm size or patch: a name timm registers, the kwargs decide, and the notes say so
    assert spec["model_name"] == "vit_base_patch16_224"
    assert any("timm registers no vit_custom_patch4" in note for note in spec["notes"])
    # timm's load_pretrained keeps the written head only if the overlay states its size; and
    # timm's data config scales the input as vitlab does only if the overlay states mean and std
    size = [3, *model.cfg.img_size]
    assert spec["pretrained_cfg_overlay"] == {"file": path.name, "num_classes": 5, "input_size": size,
                                              "test_input_size": size, "crop_pct": 1.0, "test_crop_pct": 1.0,
                                              "crop_mode": "squash", "interpolation": "bilinear",
                                              "mean": [0.5] * 3, "std": [0.5] * 3}
    assert (kw["embed_dim"], kw["depth"], kw["num_heads"], kw["img_size"]) == (32, 2, 2, list(model.cfg.img_size))
    assert (kw.get("act_layer"), kw["global_pool"], kw["class_token"], kw["fc_norm"]) == \
        (("gelu_tanh" if model.cfg.gelu == "tanh" else None), ("token" if "classifier" not in fields else "avg"),
         "classifier" not in fields, False)
    again = load_model(path)  # heads, GELU, pooling and size come back from the .timm.json
    assert again.cfg == replace(model.cfg, posemb_resample="bicubic", name=again.cfg.name)
    assert torch.equal(logits(again, model.cfg.img_size), logits(model, model.cfg.img_size))


def test_timm_hybrid_export_uses_timm_names(tmp_path):
    ckpt = random_checkpoint(30, patch=1, grid=2, resnet_layers=(1, 1), hybrid=True)
    model = load_official_npz(ckpt)
    with pytest.warns(ConventionWarning, match="ws_eps"):  # vit_jax's stem standardises differently from timm's
        path = save_model(model, tmp_path / "hybrid.safetensors", format="timm")
    written = safetensors.torch.load_file(path)
    assert set(written) == set(to_timm_names(ckpt))  # the names timm's resnetv2 + HybridEmbed use
    spec = json.loads((tmp_path / "hybrid.timm.json").read_text())
    assert any("ws_eps" in note for note in spec["notes"])
    # timm builds 4 stem layouts only: no name, and the notes say so plainly
    assert spec["model_name"] is None
    assert any("timm.create_model cannot build this model" in note for note in spec["notes"])


@pytest.mark.parametrize("name, fields, expected", [
    ("ViT-B/8", dict(img_size=32), "vit_base_patch8_224"),     # the size timm lacks: its 224 entry point
    ("ViT-B/16", dict(img_size=384), "vit_base_patch16_384"),  # registered as it is
    ("ViT-L/16", dict(img_size=512), "vit_large_patch16_224"),
    ("ViT-H/16", dict(), "vit_base_patch16_224"),              # no huge/16 in timm: the patch decides
    ("R50x1+ViT-B/16", dict(img_size=64), "vit_base_r50_s16_224"),
])
def test_timm_export_names_a_model_timm_registers(name, fields, expected):
    from vitlab.models.registry import get_config
    from vitlab.weights.timm import TIMM_HYBRID_NAMES, TIMM_VIT_NAMES, timm_model_name

    chosen, note = timm_model_name(get_config(name, **fields))
    assert chosen == expected and chosen in TIMM_VIT_NAMES + TIMM_HYBRID_NAMES
    assert (note is None) == (name == "ViT-B/16")


def test_timm_export_says_what_timm_cannot_take(tmp_path):
    model = random_model(replace(TINY, ln_eps=1e-12))
    with pytest.warns(ConventionWarning, match="ln_eps"):
        save_model(model, tmp_path / "v.safetensors", format="timm")
    assert any("ln_eps" in n for n in json.loads((tmp_path / "v.timm.json").read_text())["notes"])
    with pytest.raises(WeightsError, match="representation_size"):
        save_model(random_model(replace(TINY, representation_size=7)), tmp_path / "r.safetensors", format="timm")


@pytest.mark.parametrize("fields", [dict(attn_bias="distance"), dict(attn_bias="distance_no_self", attn_offsets=True)])
def test_timm_export_refuses_a_distance_prior_before_writing(tmp_path, fields):
    """timm's attention has no distance prior: its parameters were written under their vitlab names into a timm
    file that neither timm (unexpected keys) nor vitlab's read-back could load, vitlab convert failing after
    writing it (and with --no-check, succeeding)."""
    with pytest.raises(WeightsError, match=rf"^timm's VisionTransformer cannot hold this model: "
                                           rf"attn_bias='{fields['attn_bias']}' \("):
        save_model(random_model(replace(TINY, **fields)), tmp_path / "d.safetensors", format="timm")
    assert not (tmp_path / "d.safetensors").exists() and not (tmp_path / "d.timm.json").exists()


# ------------------------------------------------------------------------------ official


def test_official_export_warns_when_vit_jax_computes_otherwise(tmp_path):
    model = random_model(replace(TINY, gelu="exact"))
    with pytest.warns(ConventionWarning, match="gelu"):
        save_model(model, tmp_path / "m.npz", format="official")
    again = load_model(tmp_path / "m.npz")
    assert again.cfg.gelu == "tanh"  # what vit_jax computes with these arrays


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(WeightsError, match="format='onnx'.*'vitlab', 'official', 'hf', 'timm'"):
        save_model(random_model(TINY), tmp_path / "x", format="onnx")


def test_hf_non_square_export_resizes_on_load(tmp_path):
    model = random_model(replace(TINY, img_size=(16, 24), posemb_resample="bicubic"))
    save_model(model, tmp_path / "hf", format="hf")
    # the saved (16, 24) grid comes from config.json (16 * 24 / 16 = 24 positions, not a square)
    bigger = load_model(tmp_path / "hf", img_size=(24, 24))
    assert bigger.cfg.img_size == (24, 24) and bigger.pos_embed.weight.shape == (1, 37, 32)
    # (transformers' own interpolate_pos_encoding assumes a square grid, so it is no reference here)
    expected = load_model(tmp_path / "hf", dynamic_img_size=True)
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        assert (bigger(x) - expected(x)).abs().max() < 1e-5


@pytest.mark.parametrize("img_size", [(32, 48), (30, 46)], ids=["exact", "padded"])
def test_timm_hybrid_export_at_a_non_square_size_reads_back(tmp_path, img_size):
    # a 4x6 grid and its [class] position count 25, a square: the hybrid's table was taken for timm's
    # no_embed_class (a zero [class] row prepended) whatever size the .timm.json gave, and refused
    model = load_official_npz(random_checkpoint(31, patch=1, grid=4, resnet_layers=(1, 1)), img_size=img_size)
    assert model.cfg.grid_size == (4, 6)
    with pytest.warns(ConventionWarning):
        path = save_model(model, tmp_path / "hybrid.safetensors", format="timm")
    again = load_model(path)
    assert again.cfg.img_size == img_size and again.pos_embed.weight.shape == (1, 25, 32)
    assert torch.equal(again.pos_embed.weight, model.pos_embed.weight)


def test_an_official_hybrid_of_another_root_is_refused(tmp_path):
    """vit_jax's .npz has no place for a hybrid's root stride or pool, and is read back with its 7x7/2 root
    and max-pool: a stem of root_stride=1 or no pool (small images) was written and read back as another
    model, other logits without a word."""
    from vitlab.config import ResNetConfig

    for fields, reason in ((dict(root_stride=1), "root_stride=1"), (dict(root_pool=False), "root_pool=False")):
        stem = ResNetConfig(layers=(1,), width_factor=0.5, img_size=32, **fields)
        model = build_model(replace(TINY, img_size=32, patch_size=1, resnet=stem))
        expected = rf"^vit_jax's \.npz cannot hold this model: the hybrid stem's {reason} \("
        with pytest.raises(WeightsError, match=expected):
            save_model(model, tmp_path / "h.npz", format="official")
        assert not (tmp_path / "h.npz").exists()
