"""What `vitlab predict` hands a model for an image, and an image preprocessed as an export's record says:
the tests of what exports state about a model's input compare the two."""
import numpy as np
import torch
from PIL import Image


def predict_input(checkpoint, image, monkeypatch) -> torch.Tensor:
    """The images tensor `vitlab predict` hands the model for ``image``: its own preprocessing, as it runs."""
    import vitlab.weights
    from vitlab.cli import main

    seen, load = [], vitlab.weights.load_model

    def load_and_watch(*args, **kwargs):
        model = load(*args, **kwargs)
        model.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].clone()))
        return model

    monkeypatch.setattr(vitlab.weights, "load_model", load_and_watch)
    assert main(["predict", "--checkpoint", str(checkpoint), str(image), "--no-fast"]) == 0
    return seen[0]


def as_recorded(record, image) -> torch.Tensor:
    """``image`` preprocessed by the record an export carries, as a deployer without vitlab would read it."""
    height, width = record["image_size"]
    filters = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}
    pixels = Image.open(image).convert(record["channel_order"]).resize((width, height),
                                                                       filters[record["interpolation"]])
    p = torch.from_numpy(np.asarray(pixels).astype(np.float64))  # (H, W, C)
    x = (p * record["rescale_factor"] - torch.tensor(record["mean"])) / torch.tensor(record["std"])
    assert record["input_layout"] == "NCHW"
    return x.permute(2, 0, 1).unsqueeze(0).float()



# timm's defaults where a pretrained_cfg states nothing (timm.data.constants), and the pretrained_cfg of
# the ViTs it registers (vision_transformer.py's _cfg), which an overlay is laid over
TIMM_DEFAULTS = {"input_size": (3, 224, 224), "interpolation": "bicubic", "mean": (0.485, 0.456, 0.406),
                 "std": (0.229, 0.224, 0.225), "crop_pct": 0.875, "crop_mode": "center"}
TIMM_VIT_CFG = {"input_size": (3, 224, 224), "crop_pct": 0.9, "interpolation": "bicubic", "mean": (0.5, 0.5, 0.5),
                "std": (0.5, 0.5, 0.5)}


def timm_eval_input(pretrained_cfg, image, use_test_size=False) -> torch.Tensor:
    """``image`` as timm's eval transform gives it to a model of ``pretrained_cfg``: a transcription of
    ``resolve_data_config(pretrained_cfg=..., use_test_size=...)`` and ``create_transform(**config)``
    (``transforms_imagenet_eval``: the size over crop_pct, resized by crop_mode, centre-cropped to the size,
    ToTensor, Normalize), for PIL images; timm itself is not installed here."""
    cfg = {k: v for k, v in pretrained_cfg.items() if v is not None}
    size = cfg.get("test_input_size") if use_test_size and cfg.get("test_input_size") else \
        cfg.get("input_size", TIMM_DEFAULTS["input_size"])
    crop_pct = (cfg.get("test_crop_pct") if use_test_size and cfg.get("test_crop_pct") else None) or \
        cfg.get("crop_pct") or TIMM_DEFAULTS["crop_pct"]
    get = lambda name: cfg.get(name) or TIMM_DEFAULTS[name]  # noqa: E731
    height, width = size[-2:]
    scaled = (int(height / crop_pct), int(width / crop_pct))  # math.floor of a positive number
    interpolation = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[get("interpolation")]
    img = Image.open(image).convert("RGB")
    if get("crop_mode") == "squash":  # Resize((h, w)): each side to its size, the aspect ratio not kept
        img = img.resize((scaled[1], scaled[0]), interpolation)
    elif get("crop_mode") == "center" and scaled[0] == scaled[1]:  # Resize(s): the shorter side to s
        short, long = sorted(img.size)
        other = int(scaled[0] * long / short)
        img = img.resize((scaled[0], other) if img.width == short else (other, scaled[0]), interpolation)
    else:
        raise NotImplementedError(f"crop_mode={get('crop_mode')!r} for {scaled}")
    top, left = int(round((img.height - height) / 2.0)), int(round((img.width - width) / 2.0))  # CenterCrop
    img = img.crop((left, top, left + width, top + height))
    p = torch.from_numpy(np.asarray(img).astype(np.float64)) / 255  # ToTensor
    x = (p - torch.tensor(get("mean"), dtype=torch.float64)) / torch.tensor(get("std"), dtype=torch.float64)
    return x.permute(2, 0, 1).unsqueeze(0).float()
