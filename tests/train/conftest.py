import pytest

from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from vitlab.train.overrides import with_changes

TINY_MODEL = dict(img_size=8, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, name="ViT-tiny/4")


def tiny_config(out, **changes) -> TrainConfig:
    """A ViT of ~5k parameters on the 8x8 digits: a step takes milliseconds.

    ``changes``: fields by their flat names (``steps=8``, ``crop="pad"``), which
    ``legacy.LEGACY_NAMES`` maps onto the sections."""
    cfg = TrainConfig(
        recipe="test",
        model=ModelConfig(name="ViT-Ti/16", overrides=dict(TINY_MODEL)),
        data=DataConfig(source="digits", val_split=100),
        augment=AugmentConfig(crop="none", flip=False),
        optim=OptimConfig(optimizer="adam", lr=3e-3, weight_decay=0.1, batch_size=32, steps=6, warmup=2,
                          decay="cosine", clip_norm=1.0),
        run=RunConfig(precision="fp32", eval_every=0, log_every=2, ckpt_every=0, keep_ckpts=2, threads=1,
                      out=str(out)),
    )
    return with_changes(cfg, changes)


@pytest.fixture
def tiny(tmp_path):
    return lambda name="run", **changes: tiny_config(tmp_path / name, **changes)


class RunClock:
    """The training loop's clock (``loop.clock``) in a test's hands: it stands still but for
    ``step_s`` seconds per training step (a number, or a function of the step's (H, W)) and
    ``eval_s`` per evaluation, so that a time-limited run plans, refits and stops at the same
    steps on any machine, busy or idle.  ``now``: its reading, which a test may move on."""

    def __init__(self, monkeypatch, step_s, eval_s: float) -> None:
        import vitlab.train.loop as loop
        from vitlab.eval.evaluator import Evaluator

        self.now, self.step_s, self.eval_s = 0.0, step_s, eval_s
        real_step, real_run = loop.train_step, Evaluator.run

        def train_step(setup, batches, lr, size):
            result = real_step(setup, batches, lr, size)
            self.now += self.step_s(size) if callable(self.step_s) else self.step_s
            return result

        def run(evaluator, *args, **kwargs):
            result = real_run(evaluator, *args, **kwargs)
            self.now += self.eval_s
            return result

        monkeypatch.setattr(loop, "clock", lambda: self.now)
        monkeypatch.setattr(loop, "train_step", train_step)
        monkeypatch.setattr(Evaluator, "run", run)


@pytest.fixture
def run_clock(monkeypatch):
    """``run_clock(step_s, eval_s)``: the loop's clock from now on is a ``RunClock``."""
    return lambda step_s, eval_s: RunClock(monkeypatch, step_s, eval_s)
