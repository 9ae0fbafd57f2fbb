"""Numerics: a NaN loss stops the run naming the step, the example and the last good
checkpoint, or (run.on_nonfinite=skip) is left out and counted; non-finite gradients are
never applied; fp16's gradient scaler recovers from an overflowing loss scale."""
import math
import re

import pytest
import torch

import vitlab.data.transforms as transforms
import vitlab.train.inputs as inputs
from vitlab.cli import main
from vitlab.data.splits import stratified_split
from vitlab.train import train
from vitlab.train.build import build
from vitlab.train.checkpoint import list_checkpoints, load_checkpoint
from vitlab.train.metrics import read_jsonl
from vitlab.train.numerics import NonFiniteError
from vitlab.train.step import autocast, endless, loss_fn, train_step

MARK = 7  # a poisoned image is all 7s (no digit is a flat grey), and becomes all NaN after the transform
POOL, VAL = 96, 32  # data.train_examples, data.val_split: 64 training examples, 2 steps of 32 per epoch


def poisoned_example(split_seed: int = 0) -> int:
    """A digits index that lands in the training split (train_examples=96, val_split=32):
    the sample and split ``build_splits`` draws, redone here."""
    from vitlab.data.digits import load_digits_dataset

    labels = load_digits_dataset(8).labels
    _, pool = stratified_split(labels, POOL, split_seed + 1)
    train_idx, _ = stratified_split(labels[pool], VAL, split_seed)
    return int(pool[train_idx[5]])


@pytest.fixture
def poison(monkeypatch):
    """Make digits example ``poisoned_example()`` an image of NaNs; returns its index."""
    index = poisoned_example()
    real_load, real_build = inputs.load_dataset, transforms.build_transform

    def load_dataset(cfg, image_size):
        data = real_load(cfg, image_size)
        data.images[index] = MARK
        return data

    def build_transform(spec):
        inner = real_build(spec)

        def transform(x, y, generator, **kw):
            marked = (x.flatten(1) == MARK).all(1)
            x, y = inner(x, y, generator, **kw)
            x[marked] = float("nan")
            return x, y

        return transform

    monkeypatch.setattr(inputs, "load_dataset", load_dataset)
    monkeypatch.setattr(transforms, "build_transform", build_transform)
    return index


def test_a_nan_loss_stops_the_run_naming_the_step_the_example_and_the_last_checkpoint(poison, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["train", "--recipe", "demo", "--data", "digits", "--steps", "6", "--batch-size", "32", "--quiet",
            "--out", str(out), "--set", f"data.train_examples={POOL}", "--set", f"data.val_split={VAL}",
            "--set", "model.img_size=8", "--set", "model.patch_size=4", "--set", "model.width=16",
            "--set", "model.depth=1", "--set", "model.num_heads=2", "--set", "model.mlp_dim=32",
            "--set", "run.threads=1", "--set", "run.tensorboard=false", "--set", "run.ckpt_every=1",
            "--set", "augment.crop=none"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    found = re.search(r"^vitlab train: error: step (\d+): the training loss is not finite \(nan\) on examples "
                      r"\[(\d+)\] of data.source='digits' .*; the step was not applied; ", err)
    assert found, err
    step, example = int(found.group(1)), int(found.group(2))
    assert example == poison  # the index in the data set, not the position in the training split
    assert step <= 2  # 2 steps make an epoch, and every epoch holds the example
    if step == 1:
        assert "no checkpoint was written before it" in err
    else:
        named = re.search(r"the last good checkpoint is (\S+)\. ", err).group(1)
        assert named == str(out / "checkpoints" / "ckpt-00000001.pt")
        assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["ckpt-00000001.pt"]
        state = load_checkpoint(named)
        assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_skip_leaves_nan_steps_out_counts_them_and_stops_past_the_bound(poison, tiny):
    common = {"train_examples": POOL, "val_split": VAL, "steps": 6, "batch_size": 32, "ema_decay": 0.9,
              "log_every": 1, "run.on_nonfinite": "skip"}
    summary = train(tiny("skip", **common), verbose=False)
    assert summary["skipped_steps"] == 3  # once per epoch of 2 steps
    state = load_checkpoint(list_checkpoints(f"{tiny('skip').run.out}/checkpoints")[-1])
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert all(torch.isfinite(v).all() for v in state["ema"]["module"].values())
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {3.0}  # 6 steps, 3 of them left out: the optimiser took 3
    records = read_jsonl(f"{tiny('skip').run.out}/metrics.jsonl")
    assert [r["skipped_steps"] for r in records][-1] == 3
    # one record per step: the skipped steps' have no loss to show, the others a finite one
    assert sum(not math.isfinite(r["loss"]) for r in records) == 3

    with pytest.raises(NonFiniteError, match=r"3 steps skipped, more than run.max_skipped_steps=2"):
        train(tiny("bounded", **common, **{"run.max_skipped_steps": 2}), verbose=False)


def test_bf16_gradients_that_are_not_finite_are_not_applied(tiny):
    s = build(tiny(precision="bf16", ema_decay=0.9))
    first = next(iter(s.model.parameters()))
    first.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    ema_before = {k: v.clone() for k, v in s.ema.module.state_dict().items()}
    result = train_step(s, endless(s.stream), lr=1e-2, size=s.img_size[0]).read()
    assert result.nonfinite == "gradients" and not result.applied and math.isfinite(result.loss)
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())
    assert all(torch.equal(ema_before[k], v) for k, v in s.ema.module.state_dict().items())
    # the optimiser was told on the device: its step count and moments did not move
    assert all(float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
               for state in s.optimizer.state.values())
    assert all(p.grad is None for p in s.model.parameters())


BN_HYBRID = dict(img_size=8, patch_size=1, width=16, depth=1, num_heads=2, mlp_dim=32, name="R-tiny-BN+ViT",
                 resnet=dict(layers=(1,), img_size=8, norm="batch", width_factor=0.5))


def test_a_step_left_out_leaves_the_batch_norm_statistics_as_they_were(tiny):
    # a training forward updates BatchNorm's running statistics before the step is known to be bad:
    # a NaN image made them NaN, in the model and (copied) in the EMA, and every evaluation after
    # scored NaN logits though the step was "not applied"
    s = build(tiny(model_overrides=BN_HYBRID, ema_decay=0.9))
    batches = endless(s.stream)
    assert train_step(s, batches, lr=1e-2, size=s.img_size[0]).read().applied  # the statistics have moved
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    ema_before = {k: v.clone() for k, v in s.ema.module.state_dict().items()}
    hook = s.model.register_forward_pre_hook(lambda module, args: (torch.full_like(args[0], float("nan")),))
    result = train_step(s, batches, lr=1e-2, size=s.img_size[0]).read()
    assert result.nonfinite == "loss" and not result.applied
    assert any("running_mean" in k for k in before)
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())
    assert all(torch.equal(ema_before[k], v) for k, v in s.ema.module.state_dict().items())
    hook.remove()
    assert train_step(s, batches, lr=1e-2, size=s.img_size[0]).read().applied  # and they move again
    assert not torch.equal(before["stem.gn_root.running_mean"], s.model.stem.gn_root.running_mean)
    assert torch.equal(s.ema.module.stem.gn_root.running_mean, s.model.stem.gn_root.running_mean)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "muon"])
def test_every_optimiser_leaves_a_step_out_on_the_device(tiny, optimizer):
    # found_inf (a device flag) leaves a step out: no parameter, moment, momentum or count moves,
    # even when the gradients are NaN; the next step is applied as usual
    from vitlab.train.optim import skips_on_device

    s = build(tiny(optimizer=optimizer, momentum=0.9))
    assert skips_on_device(s.optimizer)
    batches = endless(s.stream)
    train_step(s, batches, lr=1e-2, size=s.img_size[0])  # one real step: the state exists
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    state_before = {k: v.clone() for k, v in _flat_state(s.optimizer).items()}
    x, targets = next(batches)
    with autocast(s.world.device, "fp32"):
        loss_fn(s.trained(x), targets, "softmax_xent").backward()
    for p in s.model.parameters():
        p.grad.fill_(float("nan"))
    s.optimizer.found_inf = torch.ones(())
    s.optimizer.step()
    del s.optimizer.found_inf
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())
    assert all(torch.equal(state_before[k], v) for k, v in _flat_state(s.optimizer).items())
    s.optimizer.zero_grad(set_to_none=True)
    assert train_step(s, batches, lr=1e-2, size=s.img_size[0]).read().applied
    assert not all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())


def _flat_state(optimizer) -> dict:
    return {f"{i}.{name}": value for i, state in enumerate(optimizer.state.values())
            for name, value in state.items() if torch.is_tensor(value)}


def test_fp16_gradient_scaler_recovers_from_an_overflowing_loss_scale(tiny):
    # fp16 holds at most 65504: at a scale of 2^28 this model's scaled gradients overflow (it
    # settles at 2^17), so the first steps are left out while the scale halves
    huge = 2.0 ** 28
    summary = train(tiny("fp16", precision="fp16", steps=24, log_every=24, **{"run.loss_scale": huge}), verbose=False)
    overflows = summary["overflow_steps"]
    assert 0 < overflows < 24 and summary["skipped_steps"] == 0
    assert summary["loss_scale"] == huge / 2 ** overflows  # halved at every overflow, never grown (2000 steps)
    state = load_checkpoint(list_checkpoints(f"{tiny('fp16').run.out}/checkpoints")[-1])
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {24.0 - overflows}
    assert state["scaler"]["scale"] == huge / 2 ** overflows  # a resume continues with the adapted scale

    # without the scaler's check, the same first step with the same static scale ruins the weights
    s = build(tiny("naive", precision="fp16"))
    x, targets = next(endless(s.stream))
    with autocast(s.world.device, "fp16"):
        loss = loss_fn(s.trained(x), targets, "softmax_xent")
    (loss * huge).backward()
    for p in s.model.parameters():
        p.grad /= huge
    s.optimizer.step()
    assert not all(torch.isfinite(p).all() for p in s.model.parameters())


@pytest.mark.parametrize("backend", ["vitlab", "torchao"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_an_fp8_run_swaps_its_blocks_keeps_plain_weights_and_catches_a_nan_as_bf16_does(tiny, monkeypatch, scaling,
                                                                                         backend):
    """The run's own path, built on the CPU: the refusal (resolve.check_fp8) is set aside, since
    the CPU emulates the fp8 products the test needs; by vitlab's arithmetic and by torchao's."""
    import vitlab.train.resolve as resolve_module
    from vitlab.fast import Float8Linear

    if backend == "torchao":
        pytest.importorskip("torchao.float8")
    monkeypatch.setattr(resolve_module, "check_fp8", lambda *args: None)
    s = build(tiny(precision="bf16", **{"run.fp8": scaling, "run.fp8_backend": backend}))
    assert s.fp8.scaling == scaling and s.fp8.kept == () and s.fp8.backend == backend
    assert s.fp8.swapped == ("blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2")
    assert all(isinstance(s.model.get_submodule(name), Float8Linear) for name in s.fp8.swapped)
    assert all(s.model.get_submodule(name).fp8_backend == backend for name in s.fp8.swapped)
    assert list(s.model.state_dict()) == list(build(tiny(precision="bf16")).model.state_dict())
    assert train_step(s, endless(s.stream), lr=1e-2, size=s.img_size[0]).read().applied

    fc1 = s.model.blocks[0].mlp.fc1
    fc1.register_forward_pre_hook(lambda module, args: (torch.full_like(args[0], float("nan")),))
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    result = train_step(s, endless(s.stream), lr=1e-2, size=s.img_size[0]).read()
    assert result.nonfinite == "loss" and not result.applied
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())
