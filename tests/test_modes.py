"""``vitlab.modes.evaluating``: eval mode inside the block, each module's own mode back after it."""
import pytest
from torch import nn

from vitlab.modes import evaluating


def mixed() -> nn.Module:
    """Training, but for a frozen part held in eval mode, and a module inside that part that the
    caller set training again: no one mode of the root describes it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Dropout(0.5)), nn.Linear(4, 2))
    model.train()
    model[1].eval()
    model[1][1].train()
    return model


def modes(model: nn.Module) -> dict:
    return {name: m.training for name, m in model.named_modules()}


def test_every_module_in_eval_mode_inside_and_its_own_mode_after():
    model = mixed()
    before = modes(model)
    with evaluating(model) as inside:
        assert inside is model
        assert not any(modes(model).values())
    assert modes(model) == before
    assert before == {"": True, "0": True, "1": False, "1.0": False, "1.1": True, "2": True}


def test_modes_given_back_after_an_exception_in_the_block():
    model = mixed()
    before = modes(model)
    with pytest.raises(RuntimeError, match="inside"):
        with evaluating(model):
            raise RuntimeError("inside")
    assert modes(model) == before


def test_a_model_in_eval_mode_stays_so():
    model = mixed().eval()
    with evaluating(model):
        pass
    assert not any(modes(model).values())
