"""Hugging Face ViT weights: vitlab must compute what transformers computes."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vitlab.weights import WeightsError, load_model  # noqa: E402

HF_CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                 image_size=16, patch_size=4, num_channels=3, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)


def randomised(model):
    """HF initialises biases to 0 and LayerNorm to 1; random values test every mapping."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2).add_(1.0 if p.ndim == 1 and p.shape[0] == 32 else 0.0)
    return model.eval()


@pytest.fixture(scope="module")
def hf_classifier():
    cfg = transformers.ViTConfig(**HF_CONFIG, num_labels=5)
    return randomised(transformers.ViTForImageClassification(cfg))


def to_v4_layout(sd):
    """transformers >= 5 names -> transformers 4 / hub-file names, written out."""
    renames = [
        (".layers.", ".encoder.layer."),
        (".attention.q_proj.", ".attention.attention.query."),
        (".attention.k_proj.", ".attention.attention.key."),
        (".attention.v_proj.", ".attention.attention.value."),
        (".attention.o_proj.", ".attention.output.dense."),
        (".mlp.fc1.", ".intermediate.dense."),
        (".mlp.fc2.", ".output.dense."),
    ]
    out = {}
    for k, v in sd.items():
        for new, old in renames:
            k = k.replace(new, old)
        out[k] = v
    return out


@pytest.mark.parametrize("layout", ["v5", "v4"])
def test_classifier_logits_match(hf_classifier, layout):
    sd = hf_classifier.state_dict()
    assert "vit.layers.0.attention.q_proj.weight" in sd  # the layout of the installed transformers
    if layout == "v4":
        sd = to_v4_layout(sd)
        assert "vit.encoder.layer.1.attention.attention.key.bias" in sd
    model = load_model(sd, num_heads=2)
    assert (model.cfg.gelu, model.cfg.ln_eps, model.cfg.posemb_resample) == ("exact", 1e-12, "bicubic")
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        diff = (model(x) - hf_classifier(pixel_values=x).logits).abs().max()
    assert diff < 1e-4


def test_pooler_next_to_a_classifier_is_ignored_as_hf_does(hf_classifier):
    sd = dict(hf_classifier.state_dict())
    sd["vit.pooler.dense.weight"], sd["vit.pooler.dense.bias"] = torch.randn(32, 32), torch.randn(32)
    model = load_model(sd, num_heads=2)
    assert model.pre_logits is None
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert (model(x) - hf_classifier(pixel_values=x).logits).abs().max() < 1e-4


@pytest.mark.parametrize("size", [(24, 24), (16, 28)])
def test_interpolated_resolution_matches(hf_classifier, size):
    model = load_model(hf_classifier.state_dict(), num_heads=2, dynamic_img_size=True)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        ours = model(x)
        theirs = hf_classifier(pixel_values=x, interpolate_pos_encoding=True).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_static_resize_uses_the_same_bicubic_resampling(hf_classifier):
    model = load_model(hf_classifier.state_dict(), num_heads=2, img_size=24)
    assert model.cfg.img_size == (24, 24) and model.pos_embed.weight.shape == (1, 37, 32)
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        diff = (model(x) - hf_classifier(pixel_values=x, interpolate_pos_encoding=True).logits).abs().max()
    assert diff < 1e-4


def test_vit_model_pooler_is_the_pre_logits_layer():
    hf = randomised(transformers.ViTModel(transformers.ViTConfig(**HF_CONFIG), add_pooling_layer=True))
    model = load_model(to_v4_layout({"vit." + k: v for k, v in hf.state_dict().items()}), num_heads=2)
    assert model.cfg.representation_size == 32 and model.cfg.num_classes == 0
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        diff = (model(x) - hf(pixel_values=x).pooler_output).abs().max()
    assert diff < 1e-4
    bare = load_model(hf.state_dict(), num_heads=2)  # a bare ViTModel has no "vit." prefix
    with torch.no_grad():
        assert (bare(x) - model(x)).abs().max() == 0


def test_saved_directory_needs_no_heads(hf_classifier, tmp_path):
    hf_classifier.save_pretrained(tmp_path)  # config.json + model.safetensors, read without downloading
    model = load_model(tmp_path, num_classes=3)
    assert model.cfg.num_heads == 2 and model.head.weight.shape == (3, 32) and not model.head.weight.any()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = hf_classifier.vit(pixel_values=x).last_hidden_state[:, 0]
        diff = (model.forward_head(model.forward_features(x), pre_logits=True) - ref).abs().max()
    assert diff < 1e-4


def test_heads_are_required_and_checked(hf_classifier):
    with pytest.raises(WeightsError, match="num_heads"):
        load_model(hf_classifier.state_dict())
    with pytest.raises(WeightsError, match="not a ViT-B/16.*width=32"):
        load_model(hf_classifier.state_dict(), name="ViT-B/16")


IMAGENET = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


@pytest.mark.parametrize("processor", [IMAGENET, dict(do_normalize=False), dict(image_mean=0.5, image_std=0.5)],
                         ids=["imagenet", "no-normalize", "official"])
def test_a_folder_s_image_processor_scaling_is_taken_into_the_weights(hf_classifier, tmp_path, processor):
    """vitlab gives its models uint8 pixels as p / 127.5 - 1 (``to_float``, the official scaling); a folder
    whose image processor scales them otherwise (ImageNet's mean and std) was scored on vitlab's input
    without a word.  Loaded, it computes from vitlab's input what transformers computes from the
    processor's pixel_values: the difference is taken into the patch embedding."""
    from vitlab.data.transforms import to_float

    hf_classifier.save_pretrained(tmp_path)
    image_processor = transformers.ViTImageProcessor(do_resize=False, **processor)
    image_processor.save_pretrained(tmp_path)
    pixels = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    inputs = image_processor(images=list(pixels.permute(0, 2, 3, 1).numpy()), return_tensors="pt").pixel_values
    model = load_model(tmp_path)
    with torch.no_grad():
        diff = (model(to_float(pixels)) - hf_classifier(pixel_values=inputs).logits).abs().max()
    assert diff < 1e-4
    if "image_mean" in processor and processor["image_mean"] == 0.5:  # vitlab's own: the weights as they were
        assert torch.equal(model.patch_embed.weight, load_model(hf_classifier.state_dict(), num_heads=2).patch_embed.weight)


def test_an_image_processor_that_cannot_scale_is_refused_naming_the_file(hf_classifier, tmp_path):
    hf_classifier.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text('{"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0, 0.5]}')
    with pytest.raises(WeightsError, match="preprocessor_config.json.*image_std"):
        load_model(tmp_path)
