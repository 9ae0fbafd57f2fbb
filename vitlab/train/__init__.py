"""Training: the config (config.py), what a run builds (build.py), one optimiser step
(step.py), the time budget (time_budget.py), the loop (loop.py), what a checkpoint holds
(state.py, checkpoint.py), optimiser (optim.py), learning-rate schedules (schedules.py),
weight averaging (ema.py), metrics and progress (metrics.py), multi-process runs
(distributed.py).  Evaluations are ``vitlab.eval.Evaluator``'s, as `vitlab eval`'s are.
"""
from .config import TrainConfig, apply_overrides, check_can_run, from_dict, load_recipe
from .loop import train

__all__ = ["TrainConfig", "apply_overrides", "check_can_run", "from_dict", "load_recipe", "train"]
