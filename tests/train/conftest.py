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


@pytest.fixture(scope="session")
def warm_process(tmp_path_factory):
    """One short training run per test process: the first ``train`` in a process pays seconds
    of one-time imports and data loading (torch._dynamo, scikit-learn's digits), which must
    not eat the few seconds a time-limited test runs for, whichever test comes first."""
    from vitlab.train import train

    train(tiny_config(tmp_path_factory.mktemp("warm") / "run", steps=2, warmup=1, tensorboard=False), verbose=False)


@pytest.fixture
def tiny(tmp_path, warm_process):
    return lambda name="run", **changes: tiny_config(tmp_path / name, **changes)
