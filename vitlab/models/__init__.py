"""Models of the paper: ViT, hybrids, Axial-ViT and the BiT ResNet baselines (plain PyTorch;
``vitlab.fast`` adds speed on top)."""
from .layers import capture_attention
from .registry import count_parameters, create_model, get_config, list_models

__all__ = ["capture_attention", "count_parameters", "create_model", "get_config", "list_models"]
