"""Weights in and out of vitlab models: the official .npz, Hugging Face, timm, safetensors.

    model = load_model("ViT-B_16.npz", img_size=384, num_classes=10)   # official, fine-tuning set-up
    model = load_model(hf_model.state_dict(), name="ViT-B/16")         # Hugging Face (either layout)
    save_model(model, "runs/b16")                                       # safetensors + config.json
    save_model(model, "hf/b16", format="hf")                            # ViTForImageClassification dir
    save_model(model, "b16.safetensors", format="timm")                 # timm state dict + .timm.json
    save_model(model, "hf/b16", format="hf", class_names=read_class_names("runs/b16"))  # id2label too
    save_model(model, "hf/b16", format="hf", loss="sigmoid_xent")       # problem_type: a sigmoid per class
    model = load_model("runs/b16")
    save_official_npz(model, "b16.npz")                                 # back to vit_jax's layout

Every loader checks the converted weights against the model and reports every
missing, unexpected and mis-shaped key in one ``WeightsError``.
"""
from .bigvision import load_big_vision
from .bit import load_bit, save_bit_npz
from .core import ConventionWarning, HeadsUnknownError, WeightsError, adapt_state_dict, infer_config, load_checked
from .huggingface import load_huggingface, save_huggingface
from .load import detect_format, load_config, load_model, read_class_names, read_loss
from .native import load_native, save_model
from .official import load_official_npz, save_official_npz
from .timm import load_timm, save_timm

__all__ = [
    "ConventionWarning",
    "HeadsUnknownError",
    "WeightsError",
    "adapt_state_dict",
    "detect_format",
    "infer_config",
    "load_big_vision",
    "load_bit",
    "load_checked",
    "load_config",
    "load_huggingface",
    "load_model",
    "load_native",
    "load_official_npz",
    "load_timm",
    "read_class_names",
    "read_loss",
    "save_bit_npz",
    "save_huggingface",
    "save_model",
    "save_official_npz",
    "save_timm",
]
