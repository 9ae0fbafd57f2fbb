"""vitlab: the Vision Transformer of Dosovitskiy et al. (ICLR 2021), faithfully, in PyTorch."""
from .config import ConfigError, ResNetConfig, ViTConfig
from .models import capture_attention, count_parameters, create_model, get_config, list_models
from . import fast
from .weights import load_model, load_official_npz, save_model, save_official_npz

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ResNetConfig",
    "ViTConfig",
    "capture_attention",
    "fast",
    "count_parameters",
    "create_model",
    "get_config",
    "list_models",
    "load_model",
    "load_official_npz",
    "save_model",
    "save_official_npz",
]
