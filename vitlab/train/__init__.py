"""Training: recipes' config (config.py), optimiser (optim.py), learning-rate schedules
(schedules.py), the loop (loop.py), weight averaging (ema.py), checkpoints
(checkpoint.py), metrics and progress (metrics.py), multi-process runs (distributed.py).
"""
from .config import TrainConfig, apply_overrides, load_recipe, validate
from .loop import evaluate, train

__all__ = ["TrainConfig", "apply_overrides", "evaluate", "load_recipe", "train", "validate"]
