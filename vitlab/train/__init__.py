"""Training: the config (config.py: its sections, checked as they are built), changing it by
name and the ``--set`` language (overrides.py), the flat names of earlier versions
(legacy.py), the architecture it trains (architecture.py), how its "auto" settings are decided,
once, for the machine (resolve.py), what a run builds (build.py),
one optimiser step (step.py), the time budget (time_budget.py), the loop (loop.py), what a
checkpoint holds (state.py, checkpoint.py), optimiser (optim.py), learning-rate schedules
and the warm-up rule (schedules.py), weight averaging (ema.py), metrics and progress
(metrics.py), multi-process runs (distributed.py).  The recipes are ``vitlab.configs``;
evaluations are ``vitlab.eval.Evaluator``'s, as `vitlab eval`'s are.
"""
from .build import check_can_run
from .config import TrainConfig, from_dict
from .loop import train
from .overrides import apply_overrides, with_changes

__all__ = ["TrainConfig", "apply_overrides", "check_can_run", "from_dict", "train", "with_changes"]
