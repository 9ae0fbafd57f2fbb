"""The BiT ResNet baselines (paper Table 7) train through the same engine, with SGD or Adam."""
import pytest

from vitlab.config import ConfigError, ResNetConfig
from vitlab.train import train
from vitlab.train.checkpoint import list_checkpoints, load_checkpoint
from vitlab.weights import load_model

TINY_BIT = {"model.name": "BiT-R50x1", "model.overrides": {"layers": (1, 1), "width_factor": 0.5, "root_pool": False},
            "model.img_size": 16}


@pytest.mark.parametrize("optimizer, state_key", [("sgd", "momentum_buffer"), ("adam", "exp_avg")])
def test_bit_trains_with_sgd_and_adam(tiny, optimizer, state_key):
    cfg = tiny(optimizer, steps=3, **TINY_BIT, **{"optim.optimizer": optimizer})
    summary = train(cfg, verbose=False)
    assert summary["steps"] == 3 and summary["model"] == "BiT-R50x1"
    model = load_model(summary["weights"])
    assert isinstance(model.cfg, ResNetConfig) and model.cfg.num_classes == 10 and model.cfg.layers == (1, 1)
    state = load_checkpoint(list_checkpoints(f"{cfg.run.out}/checkpoints")[-1])
    assert all(state_key in s for s in state["optimizer"]["state"].values())


def test_bit_refuses_vit_only_features(tiny):
    with pytest.raises(ConfigError, match="model.pre_logits"):
        train(tiny("p", **TINY_BIT, **{"model.pre_logits": True}), verbose=False)
